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
