"""Math reward: the last `\\boxed{...}` (or the `<answer>` tag) checked with math-verify.

math-verify parses both sides to sympy and compares them, so `\\frac{1}{2}`, `0.5` and
`1/2` agree. Its own time limits use `signal.alarm`, which works only on the main
thread; off the main thread they are turned off and the sandbox's kill is the only
limit (the sandbox runs this on its subprocess's main thread, so both apply there).
Named `math_reward` so that it cannot shadow the standard `math` module.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from async_grpo.rewards.registry import RewardInput, RewardOutput, reward

MAX_ANSWER_CHARS = 10_000
# sympy's LaTeX parser recurses per bracket level, and math-verify's alarm cannot always
# interrupt it (the exception can land in a weakref callback and be dropped): refuse deeper
# answers up front. Real answers nest a handful of levels.
MAX_NESTING = 64
MATH_VERIFY_TIMEOUT_S = 1  # math-verify takes whole seconds; for parse and verify each
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BRACE = re.compile(r"[{}]")
_OPEN_BRACE = re.compile(r"\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}`, or None when there is none or its braces
    never close (a truncated answer is not an answer)."""
    start = text.rfind("\\boxed")
    if start == -1:
        return None
    match = _OPEN_BRACE.match(text, start + len("\\boxed"))
    if match is None:
        return None
    depth = 0
    for brace in _BRACE.finditer(text, match.end() - 1):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return text[match.end() : brace.start()]
    return None


def extract_math_answer(completion: str) -> str | None:
    """The last `\\boxed{...}`, else the last `<answer>...</answer>`, else None."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    tags = _ANSWER.findall(completion)
    return tags[-1] if tags else None


def parse_math(text: str) -> list[Any]:
    """math-verify parse of a bare answer: try it as LaTeX (`$...$`), then as plain text."""
    from math_verify import parse  # 1 s (sympy's LaTeX parser): not at every command's start

    timeout = _timeout()
    parsed = parse(f"${text}$", parsing_timeout=timeout)
    return parsed or parse(text, parsing_timeout=timeout)


def answers_match(gold: str, predicted: str) -> bool:
    """True when math-verify finds `predicted` equal to `gold`."""
    from math_verify import verify

    gold_parsed, pred_parsed = parse_math(gold), parse_math(predicted)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=_timeout()))


@reward("math")
def math_reward(sample: RewardInput) -> RewardOutput:
    """1.0 when the extracted answer equals `sample.answer` (a string or number)."""
    predicted = extract_math_answer(sample.completion)
    if predicted is None:
        return RewardOutput(0.0, {"answer_reward": 0.0}, "no \\boxed{} or <answer> found")
    predicted = predicted.strip()
    if not predicted:
        return RewardOutput(0.0, {"answer_reward": 0.0}, "empty answer")
    if len(predicted) > MAX_ANSWER_CHARS:
        return RewardOutput(
            0.0, {"answer_reward": 0.0}, f"answer longer than {MAX_ANSWER_CHARS} chars"
        )
    if nesting_depth(predicted) > MAX_NESTING:
        return RewardOutput(
            0.0, {"answer_reward": 0.0}, f"answer nested deeper than {MAX_NESTING} brackets"
        )
    correct = answers_match(str(sample.answer), predicted)
    reason = "" if correct else "answer does not match"
    return RewardOutput(float(correct), {"answer_reward": float(correct)}, reason)


def nesting_depth(text: str) -> int:
    """The deepest nesting of (), [] and {} (unbalanced closers are ignored)."""
    depth = deepest = 0
    for ch in text:
        if ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}" and depth:
            depth -= 1
    return deepest


def _timeout() -> int | None:
    on_main = threading.current_thread() is threading.main_thread()
    return MATH_VERIFY_TIMEOUT_S if on_main else None
