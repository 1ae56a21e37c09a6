"""Math reward: extraction of the final answer and math-verify equivalence."""

import os
import time

import pytest

from async_grpo.rewards import RewardInput, get_reward
from async_grpo.rewards.math_reward import MAX_ANSWER_CHARS, extract_math_answer, last_boxed


def score(completion: str, answer: object = "0.5", limit_s: float = 5.0):  # verifier.timeout_s
    """Score on this (main) thread, where math-verify's own 1 s alarms are active."""
    start = time.monotonic()
    out = get_reward("math")(RewardInput("prompt", completion, answer, {}))
    assert time.monotonic() - start < limit_s
    return out


@pytest.mark.parametrize("predicted", [r"\frac{1}{2}", "0.5", "1/2", r"\dfrac{1}{2}", "0.50"])
@pytest.mark.parametrize("gold", [r"\frac{1}{2}", "0.5", "1/2", 0.5])
def test_equivalent_forms_agree(predicted, gold):
    out = score(f"The answer is \\boxed{{{predicted}}}.", gold)
    assert out.reward == 1.0 and out.components == {"answer_reward": 1.0}


@pytest.mark.parametrize("predicted", [r"\frac{1}{3}", "2", "-0.5", "x", r"\frac{1}{2}x"])
def test_wrong_answers_get_zero(predicted):
    out = score(f"\\boxed{{{predicted}}}")
    assert out.reward == 0.0 and out.reason == "answer does not match"


def test_last_boxed_wins_and_braces_balance():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed {\{1, 2\}}") == r"\{1, 2\}"
    assert last_boxed(r"\boxed{\frac{1}{2}") is None  # truncated: never closes
    assert score(r"\boxed{2} no wait \boxed{\frac{2}{4}}").reward == 1.0


def test_answer_tag_is_the_fallback():
    assert extract_math_answer("<answer> 1/2 </answer>") == " 1/2 "
    assert score("<think>half</think><answer>1/2</answer>").reward == 1.0


@pytest.mark.parametrize("completion", ["", "I think it is one half", r"\boxed{}", r"\boxed"])
def test_malformed_gets_zero_with_reason(completion):
    out = score(completion)
    assert out.reward == 0.0 and out.reason


def test_import_os_is_never_executed():
    if os.path.exists("/tmp/pwned"):
        os.remove("/tmp/pwned")
    out = score(r"\boxed{__import__('os').system('touch /tmp/pwned')}")
    assert out.reward == 0.0
    assert not os.path.exists("/tmp/pwned")


LATEX_50K = "\\sqrt{2}" * 6_250  # braces balance


@pytest.mark.parametrize("template", ["\\boxed{{{}}}", "<answer>{}</answer>"])
def test_fifty_thousand_character_latex_answer_is_refused_unparsed(template):
    assert len(LATEX_50K) == 50_000
    out = score(template.format(LATEX_50K), limit_s=0.5)
    assert out.reward == 0.0 and f"longer than {MAX_ANSWER_CHARS}" in out.reason


@pytest.mark.parametrize(
    "predicted", ["9^{9^{9}}", "9**9**9", "2^{2^{2^{2^{2}}}}", "2**2**2**2**2"]
)
def test_power_towers_end_within_math_verify_alarms(predicted):
    # parse and verify each stop at 1 s on the main thread: < 3 s in all.
    assert score(f"\\boxed{{{predicted}}}", "1").reward == 0.0


def test_deep_parentheses_end_quickly():
    deep = "(" * 4_000 + "1" + ")" * 4_000  # under the length cap; refused for its depth
    out = score(f"\\boxed{{{deep}}}", "2", limit_s=1.0)
    assert out.reward == 0.0 and out.reason == "answer nested deeper than 64 brackets"
    # ordinary nesting is still parsed and verified; the LaTeX parser takes ~50 ms a level
    # (AVX2 EPYC), so a few levels stay far inside the 1 s parse limit on a loaded machine
    shallow = "(" * 3 + "2" + ")" * 3
    assert score(f"\\boxed{{{shallow}}}", "2").reward == 1.0
