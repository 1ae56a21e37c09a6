"""Countdown reward: format + exact-arithmetic correctness, and hostile equations."""

import os
import time
from fractions import Fraction

import pytest

from async_grpo.rewards import RewardInput, get_reward
from async_grpo.rewards.countdown import EquationError, check_equation, evaluate

GROUND_TRUTH = {"target": 24, "numbers": [4, 6, 1]}  # 4 * 6 * 1 = 24


def score(completion: str, answer: dict = GROUND_TRUTH):
    start = time.monotonic()
    out = get_reward("countdown")(RewardInput("prompt", completion, answer, {}))
    assert time.monotonic() - start < 0.5  # the parser is linear in a capped input
    return out


def test_correct_with_think_block_scores_format_plus_answer():
    out = score("<think>4*6=24, times 1</think>\n<answer>4 * 6 * 1</answer>")
    assert out.components == {"format_reward": 0.1, "answer_reward": 1.0}
    assert out.reward == pytest.approx(1.1)
    assert out.reason == ""


def test_prompt_ending_in_think_and_equation_with_equals_sign():
    # The prompt opened <think>; "= 24" on the right is allowed when it agrees.
    assert score("so (6-4+1)*8... no.</think> <answer>(4*6)/1 = 24</answer>").reward == 1.1


def test_exact_fractions_not_floats():
    # 6 / (1 - 3/4) = 24 holds only with exact arithmetic of the intermediate 1/4.
    assert (
        score("<answer>6/(1-3/4)</answer>", {"target": 24, "numbers": [6, 1, 3, 4]}).reward == 1.1
    )
    assert evaluate("1/3+1/3+1/3").value == Fraction(1)


def test_wrong_value_gets_format_only():
    out = score("<answer>4+6+1</answer>")
    assert out.components == {"format_reward": 0.1, "answer_reward": 0.0}
    assert "evaluates to 11" in out.reason


@pytest.mark.parametrize(
    "equation, reason",
    [
        ("4*6*1*1", "expected each of"),  # 1 reused
        ("4*6", "expected each of"),  # 1 missing
        ("24", "expected each of"),  # the target itself
        ("4*6*(1/(1-1))", "division by zero"),
        ("4*6*1/0", "division by zero"),
    ],
)
def test_numbers_reused_missing_or_division_by_zero(equation, reason):
    out = score(f"<answer>{equation}</answer>")
    assert out.components["answer_reward"] == 0.0
    assert reason in out.reason


@pytest.mark.parametrize(
    "completion",
    [
        "4*6*1",  # no tags
        "<answer>4*6*1</answer><answer>4*6*1</answer>",  # two answers
        "</answer>4*6*1<answer>",
        "<answer>4*6*1",
    ],
)
def test_malformed_tags_get_nothing(completion):
    out = score(completion)
    assert out.reward == 0.0 and out.reason


def test_text_after_answer_loses_format_but_keeps_correctness():
    out = score("<answer>4*6*1</answer> I hope that helps")
    assert out.components == {"format_reward": 0.0, "answer_reward": 1.0}


def test_import_os_is_never_executed():
    if os.path.exists("/tmp/pwned"):
        os.remove("/tmp/pwned")
    out = score("<answer>__import__('os').system('touch /tmp/pwned')</answer>")
    assert out.components["answer_reward"] == 0.0
    assert "unexpected character '_'" in out.reason
    assert not os.path.exists("/tmp/pwned")


@pytest.mark.parametrize("equation", ["9**9**9", "2**2**2**2**2", "4**6*1"])
def test_power_is_refused(equation):
    out = score(f"<answer>{equation}</answer>")
    assert out.components["answer_reward"] == 0.0
    assert "'**' is not allowed" in out.reason


def test_caps_on_length_literals_and_depth():
    with pytest.raises(EquationError, match="longer than 200"):
        evaluate("(" * 10_000 + "1" + ")" * 10_000)
    with pytest.raises(EquationError, match="longer than 6 digits"):
        evaluate("1234567*2")
    with pytest.raises(EquationError, match="nesting deeper than 50"):
        evaluate("(" * 60 + "1" + ")" * 60)
    with pytest.raises(EquationError, match="nesting deeper than 50"):
        evaluate("-" * 60 + "1")
    assert evaluate("(" * 50 + "1" + ")" * 50).value == 1


def test_hostile_completions_return_quickly_with_zero():
    deep = "(" * 10_000 + "4*6*1" + ")" * 10_000
    for completion in [
        f"<answer>{deep}</answer>",
        "<answer>" + "1+" * 50_000 + "1</answer>",
        "<answer>" * 50_000,
        "x" * 1_000_000,
    ]:
        assert score(completion).components["answer_reward"] == 0.0


@pytest.mark.parametrize("equation", ["4 6 1", "4*6*1)", "(4*6*1", "4*", "4.0*6*1", "4*6*1e0", ""])
def test_bad_syntax(equation):
    correct, reason = check_equation(equation, 24, [4, 6, 1])
    assert not correct and reason.startswith("invalid equation")


def test_unary_minus_is_an_operator_not_a_number():
    assert check_equation("-(4-6)*(1+11)", 24, [4, 6, 1, 11]) == (True, "")


def test_bad_ground_truth_raises():
    with pytest.raises(ValueError, match="target"):
        score("<answer>1</answer>", {"numbers": [1]})
