"""Number rewards: the last number in the completion (inside the last `<answer>` tag
when there is one), or the first number (for base models, which go on writing after
their answer), equals the ground truth. Lenient on format, strict on the value.

`sample.answer` is a number or a string holding one ("12", "-3", "2.5"). Thousands
separators ("1,234") are accepted; fractions and expressions are not (use `math` for those).
"""

from __future__ import annotations

import re
from fractions import Fraction

from async_grpo.rewards.registry import RewardInput, RewardOutput, reward

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")
MAX_DIGITS = 64  # longer digit strings are not an answer (and would be slow to compare)


def last_number(text: str) -> Fraction | None:
    """The last number written in `text`, exactly, or None when there is none."""
    return _nth_number(text, -1)


def first_number(text: str) -> Fraction | None:
    """The first number written in `text`, exactly, or None when there is none."""
    return _nth_number(text, 0)


def _nth_number(text: str, index: int) -> Fraction | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    digits = found[index].replace(",", "")
    if len(digits) > MAX_DIGITS:
        return None
    return Fraction(digits)


@reward("last_number")
def last_number_reward(sample: RewardInput) -> RewardOutput:
    """1.0 when the last number of the completion (or of its last <answer> tag) equals
    the answer, else 0.0."""
    tags = _ANSWER.findall(sample.completion)
    return _score("last_number", last_number(tags[-1] if tags else sample.completion), sample)


@reward("first_number")
def first_number_reward(sample: RewardInput) -> RewardOutput:
    """1.0 when the first number of the completion equals the answer, else 0.0: a base
    model completing "7 - 1 =" writes its answer first, then goes on writing."""
    return _score("first_number", first_number(sample.completion), sample)


def _score(name: str, predicted: Fraction | None, sample: RewardInput) -> RewardOutput:
    truth = last_number(str(sample.answer))
    if truth is None:
        raise ValueError(f"{name}: answer {sample.answer!r} holds no number")
    if predicted is None:
        return RewardOutput(0.0, {"answer_reward": 0.0}, "no number in the completion")
    correct = predicted == truth
    return RewardOutput(
        float(correct), {"answer_reward": float(correct)}, "" if correct else "wrong number"
    )
