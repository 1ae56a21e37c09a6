"""Multi-turn environments: the interface, the name registry, the built-ins and the pool.

In: a task (the prompt row) and, turn by turn, the model's text. Out: observations (text,
untrusted: the batcher tokenises and bounds it, never runs it), rewards and `done`.
`EnvironmentWorker` hosts isolated instances, one per episode, behind a least-loaded
registry; the batcher drives the episodes (batcher/episodes.py).
"""

from async_grpo.environments.base import Environment, StepResult, Task
from async_grpo.environments.registry import environment, get_environment, known_environments

__all__ = [
    "Environment",
    "StepResult",
    "Task",
    "environment",
    "get_environment",
    "known_environments",
]
