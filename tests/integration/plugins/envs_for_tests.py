"""An environment with reward variance even for a tiny random model: two turns, each
rewarded by the vowel share of the model's text, the first answered with a fixed line.

Loaded by the environment workers through the "module:Class" spec with this folder on
PYTHONPATH."""

from async_grpo.environments import Environment, StepResult


class VowelTurns(Environment):
    max_turns = 2
    max_episode_tokens = 96

    def step(self, action: str) -> StepResult:
        score = sum(c in "aeiouAEIOU" for c in action) / len(action) if action else 0.0
        self.turns = getattr(self, "turns", 0) + 1
        done = self.turns == self.max_turns
        return StepResult("" if done else "Say more.", score, done, {"vowel_turns": 1.0})


class Hostile(Environment):
    """Misbehaves as its data row says: the row's input names the way (raise, hang, garbage,
    nan, exit, refuse); any other row plays one well-behaved step."""

    max_turns = 2
    max_episode_tokens = 64

    def reset(self, task) -> None:
        self.way = task.input.split()[0]
        if self.way == "refuse":
            raise ValueError("this row is not for me")

    def step(self, action: str):
        import os
        import time

        if self.way == "raise":
            raise RuntimeError("the environment broke")
        if self.way == "hang":
            time.sleep(8)  # past the run's step timeout
        if self.way == "garbage":
            return {"observation": "not a StepResult"}
        if self.way == "nan":
            return StepResult("", float("nan"), True)
        if self.way == "exit":
            os._exit(3)  # the worker's process ends mid-step
        return StepResult("", 1.0, True)


class SlowReset(Environment):
    """A reset that takes a second (a real environment booting its sandbox, say)."""

    def reset(self, task) -> None:
        import time

        time.sleep(1.0)

    def step(self, action: str) -> StepResult:
        return StepResult("", 1.0, True)


class HangingReset(Environment):
    """Every reset hangs (a sandbox that never boots): each group's resets time out, the
    stuck threads retire their worker, and so on for every replacement."""

    max_episode_tokens = 64

    def reset(self, task) -> None:
        import time

        time.sleep(3600)

    def step(self, action: str) -> StepResult:
        return StepResult("", 1.0, True)


class Unmakeable(Environment):
    """Cannot be instantiated: its constructor raises (a missing dependency, say)."""

    max_episode_tokens = 64

    def __init__(self) -> None:
        raise RuntimeError("the sandbox image is missing")

    def step(self, action: str) -> StepResult:
        return StepResult("", 1.0, True)
