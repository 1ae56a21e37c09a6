"""The environment interface: one instance per episode, two methods to write.

    @environment("echo")
    class Echo(Environment):
        max_turns = 2

        def reset(self, task: Task) -> None:
            self.task = task  # the prompt row; the model sees task.input as its first turn

        def step(self, action: str) -> StepResult:
            done = "bye" in action
            return StepResult("say bye", float(done), done)

`reset` and `step` may also be `async def`. The prompt (the data row's `input`) is the
first user turn. An observation is text the batcher appends to the episode as the next
user turn; `done` ends the episode; the episode's reward is the sum
of its steps' rewards. `info` carries per-step figures the metrics average per episode
(the calculator counts `tool_calls`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from async_grpo.text import not_unicode


@dataclass
class Task:
    """What an episode is about: the data row (`input` is the prompt text the model sees
    as its first user turn, `answer` the ground truth, untouched)."""

    input: str
    answer: Any
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    """One environment step. `observation` is shown to the model next (unless `done`)."""

    observation: str
    reward: float
    done: bool
    info: dict[str, float] = field(default_factory=dict)


class Environment(ABC):
    """One episode's state. `max_turns` and `max_episode_tokens` (model and environment
    tokens after the prompt) are the environment's declared limits; a run may lower them."""

    max_turns: int = 4
    max_episode_tokens: int = 512

    def reset(self, task: Task) -> None | Awaitable[None]:
        """Start the episode on `task` (the model's first turn answers `task.input`)."""
        self.task = task

    @abstractmethod
    def step(self, action: str) -> StepResult | Awaitable[StepResult]:
        """The model's turn `action` (untrusted text) -> what happens next."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Free what the instance holds (called once, however the episode ended)."""


class BadStep(ValueError):
    """An environment returned something that is not a StepResult of the right types."""


def checked(result: Any, where: str) -> StepResult:
    """`result` if it is a well-formed StepResult, else BadStep naming what is wrong."""
    if not isinstance(result, StepResult):
        raise BadStep(f"{where}: returned {type(result).__name__}, expected StepResult")
    if not isinstance(result.observation, str):
        raise BadStep(f"{where}: observation is {type(result.observation).__name__}, not str")
    if not isinstance(result.done, bool):
        raise BadStep(f"{where}: done is {type(result.done).__name__}, not bool")
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise BadStep(f"{where}: reward {reward!r} is not a finite number")
    info = result.info
    if (
        not isinstance(info, dict)
        or not all(
            isinstance(k, str) and isinstance(v, int | float) and math.isfinite(v)
            for k, v in info.items()
        )
        or not_unicode(list(info)) is not None  # its keys name metrics
    ):
        raise BadStep(f"{where}: info must map str (valid Unicode) to finite numbers, got {info!r}")
    return result
