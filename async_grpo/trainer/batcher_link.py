"""The trainer's side of the batcher actor: create or find it, then pull items from it.

Rank 0 creates the named `ExperienceBatcher` actor and steers it (start, policy version,
stop); every rank pulls its own minibatches. `Trainer` talks only to this small class, so
tests drive a real `Trainer.step` with any object that has `next` and `set_version`.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from async_grpo.batcher.types import EndOfBatch, Minibatch
from async_grpo.config import RunConfig

GET_TIMEOUT_S = 3600.0
ANSWER_SLACK_S = 60.0  # past the batcher's own limit, for its answer to arrive
GROUP_SLACK_S = 600.0


def group_timeout(cfg: RunConfig) -> timedelta:
    """The trainer's process-group timeout: past rank 0's longest named wait between two
    collectives (the batcher's `wait_generated`, then an evaluation before the push), so
    that wait says what it waited for, not an opaque gloo/NCCL timeout on the other ranks
    (the default is 30 min; `wait_generated` alone may take an hour)."""
    from async_grpo.evaluation.hook import COLLECT_SLACK_S

    generated = GET_TIMEOUT_S + ANSWER_SLACK_S  # RemoteBatcher.wait_generated's limit
    evaluation = cfg.eval.timeout_s + COLLECT_SLACK_S
    return timedelta(seconds=generated + evaluation + GROUP_SLACK_S)


class RemoteBatcher:
    """One rank's handle on the batcher actor; every call is bounded and says what it
    waited for."""

    def __init__(self, handle: Any, rank: int, timeout_s: float = GET_TIMEOUT_S) -> None:
        self.handle, self.rank, self.timeout_s = handle, rank, timeout_s

    def next(self) -> Minibatch | EndOfBatch:
        """This rank's next minibatch of the current step, then the step's EndOfBatch."""
        import ray

        ref = self.handle.get.remote(self.rank, self.timeout_s)
        return ray.get(ref, timeout=self.timeout_s + ANSWER_SLACK_S)

    def start(
        self,
        step: int,
        preloaded: dict[int, Any] | None = None,
        curriculum: dict[str, Any] | None = None,
    ) -> None:
        self._call("start", step, preloaded, curriculum)

    def curriculum_state(self, through: int) -> dict[str, Any] | None:
        """The curriculum's mastery table through step `through` (None: not drawn so)."""
        return self._call("curriculum_state", through)

    def wait_generated(self) -> None:
        """Until every step the current version allows is generated (before a push)."""
        self._call("wait_generated", self.timeout_s, timeout_s=self.timeout_s + ANSWER_SLACK_S)

    def pending(self, from_step: int) -> dict[int, Any]:
        """The generated, untrained groups of steps >= `from_step` (for a checkpoint)."""
        return self._call("pending", from_step)

    def score_failure_reasons(self, step: int) -> list[str]:
        return self._call("score_failure_reasons", step)

    def group_failure_causes(self, step: int) -> list[str]:
        return self._call("group_failure_causes", step)

    def set_version(self, version: int) -> None:
        self._call("set_version", version)

    def stop(self) -> None:
        self._call("stop")

    def _call(self, method: str, *args: Any, timeout_s: float = 300.0) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            return ray.get(getattr(self.handle, method).remote(*args), timeout=timeout_s)
        except GetTimeoutError:
            raise TimeoutError(
                f"the batcher did not answer {method} within {timeout_s:.0f}s"
            ) from None


def setup_batcher(
    cfg: RunConfig, model_dir: str, rank: int, world: int, logs: Path | None = None
) -> RemoteBatcher:
    """Rank 0 creates the named batcher actor (its output in `logs`/batcher.log when
    given); the other ranks look it up."""
    import ray

    from async_grpo.batcher.batcher import ExperienceBatcher
    from async_grpo.data.tokenize import prepare_prompts
    from async_grpo.logs import actor_runtime_env
    from async_grpo.ray_utils import NAMESPACE, on_this_node

    name = f"batcher:{os.path.abspath(cfg.output_dir)}"
    if rank == 0:
        from async_grpo.environments.verifiers_env import ENV_DATA, data_file

        data = data_file(cfg) if cfg.data == ENV_DATA else cfg.data  # `run` wrote it
        prompts = prepare_prompts(
            data, model_dir, cfg.generation.max_model_len, cfg.prompt_format, cfg.dataset
        )
        actor = ray.remote(ExperienceBatcher).options(
            name=name,
            namespace=NAMESPACE,
            num_cpus=0,
            max_concurrency=1000,
            runtime_env=actor_runtime_env(None, logs, "batcher"),
            **on_this_node(),  # with rank 0, never on a worker node that can be lost
        )
        handle = actor.remote(cfg, prompts, world)
    dist.barrier()
    if rank != 0:
        handle = ray.get_actor(name, namespace=NAMESPACE)
    return RemoteBatcher(handle, rank)
