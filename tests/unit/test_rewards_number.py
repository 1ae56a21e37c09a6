"""Number rewards (last and first): which number is read, exact comparison, and hostile
completions."""

import time

import pytest

from async_grpo.rewards import RewardInput, get_reward
from async_grpo.rewards.number import first_number, last_number


def score(completion: str, answer: object = "12"):
    return get_reward("last_number")(RewardInput("prompt", completion, answer, {}))


@pytest.mark.parametrize(
    "completion",
    ["12", "7 + 5 = 12.", "It is 3, no: 12", "<answer>12</answer> and 99", "12.0", " -0 + 12"],
)
def test_correct(completion):
    out = score(completion)
    assert (out.reward, out.components, out.reason) == (1.0, {"answer_reward": 1.0}, "")


@pytest.mark.parametrize(
    ("completion", "reason"),
    [
        ("12 is wrong, it is 13", "wrong number"),
        ("<answer>11</answer> 12", "wrong number"),
        ("twelve", "no number in the completion"),
        ("", "no number in the completion"),
        ("12.5", "wrong number"),
    ],
)
def test_wrong(completion, reason):
    out = score(completion)
    assert (out.reward, out.reason) == (0.0, reason)


def test_signs_decimals_and_separators():
    assert last_number("7 - 10 = -3") == -3
    assert last_number("total 1,234 apples") == 1234
    assert last_number("lists 3,4") == 4
    assert last_number("2.50") == last_number("2.5")
    assert score("x = -3", answer=-3).reward == 1.0
    assert score("0.1 + 0.2 = 0.3", answer="0.3").reward == 1.0  # exact, not float


def test_answer_without_number_is_an_error():
    with pytest.raises(ValueError, match="holds no number"):
        score("12", answer="twelve")


def test_hostile_completions_are_cheap():
    t = time.perf_counter()
    assert score("9" * 100_000).reward == 0.0  # too many digits to be an answer
    assert score("1," * 50_000 + "12").reward == 1.0
    assert score("-" * 100_000).reward == 0.0
    assert time.perf_counter() - t < 2.0


@pytest.mark.parametrize(
    ("completion", "reward"),
    [(" 12\n5 + 4 = 9", 1.0), (" 12", 1.0), (" 13\n12", 0.0), (" x\n", 0.0), ("-12", 0.0)],
)
def test_first_number_reads_what_a_base_model_writes_first(completion, reward):
    out = get_reward("first_number")(RewardInput("7 + 5 =", completion, "12", {}))
    assert out.reward == reward
    assert first_number("a 1,234 then 5") == 1234 and first_number("none") is None
