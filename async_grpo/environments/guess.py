"""A feedback game: guess a secret integer; each wrong guess is answered "higher" or
"lower". Reward 1.0 for finding it, plus 0.1 for each wrong guess that was still possible
given the replies so far (a guess that uses the feedback), so a policy that listens to the
replies scores above one that guesses blindly."""

from __future__ import annotations

from async_grpo.environments.base import Environment, StepResult, Task
from async_grpo.environments.registry import environment
from async_grpo.rewards.number import last_number

CONSISTENT_GUESS = 0.1


@environment("guess_number")
class GuessNumber(Environment):
    """`task.answer` is the secret; `task.metadata` may give `low` and `high` (1 and 10)."""

    max_turns = 4
    max_episode_tokens = 128

    def reset(self, task: Task) -> None:
        self.secret = int(task.answer)
        self.low = int(task.metadata.get("low", 1))
        self.high = int(task.metadata.get("high", 10))
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"guess_number: secret {self.secret} not in {self.low}..{self.high}")

    def step(self, action: str) -> StepResult:
        guess = last_number(action[:10_000])
        if guess is None or guess.denominator != 1:
            return StepResult(
                f"Reply with one whole number from {self.low} to {self.high}.",
                0.0,
                False,
                {"guesses": 0.0},
            )
        g = int(guess)
        if g == self.secret:
            return StepResult("", 1.0, True, {"guesses": 1.0})
        bonus = CONSISTENT_GUESS if self.low <= g <= self.high else 0.0
        if g < self.secret:
            self.low = max(self.low, g + 1)
            return StepResult("higher", bonus, False, {"guesses": 1.0})
        self.high = min(self.high, g - 1)
        return StepResult("lower", bonus, False, {"guesses": 1.0})
