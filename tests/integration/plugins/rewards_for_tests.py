"""A reward with variance even for a tiny random model, so the loop's gradients are real.

Loaded by the verifier through the "module:function" spec with this folder on PYTHONPATH.
"""

from async_grpo.rewards import RewardInput, RewardOutput


def vowel_share(sample: RewardInput) -> RewardOutput:
    text = sample.completion
    score = sum(c in "aeiouAEIOU" for c in text) / len(text) if text else 0.0
    return RewardOutput(score, {"vowels": score})
