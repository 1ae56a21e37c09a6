"""Exact-match reward: the `<answer>` tag (or the whole completion) equals the ground truth
after normalisation (strip, lowercase, collapse whitespace, drop a trailing '.').

`sample.answer` is a string, or a list of strings any of which is accepted.
"""

from __future__ import annotations

import re

from async_grpo.rewards.registry import RewardInput, RewardOutput, reward

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_SPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Lowercase, collapse whitespace, strip, and drop trailing periods."""
    return _SPACE.sub(" ", text).strip().lower().rstrip(".").rstrip()


@reward("exact")
def exact_reward(sample: RewardInput) -> RewardOutput:
    """1.0 when the normalised answer equals one of the normalised ground truths."""
    tags = _ANSWER.findall(sample.completion)
    predicted = normalize(tags[-1] if tags else sample.completion)
    truths = sample.answer if isinstance(sample.answer, list | tuple) else [sample.answer]
    correct = predicted in {normalize(str(t)) for t in truths}
    reason = "" if correct else "answer does not match"
    return RewardOutput(float(correct), {"answer_reward": float(correct)}, reason)
