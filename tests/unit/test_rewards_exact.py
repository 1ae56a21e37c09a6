"""Exact-match reward: normalisation and where the answer is read from."""

import os

import pytest

from async_grpo.rewards import RewardInput, get_reward
from async_grpo.rewards.exact import normalize


def score(completion: str, answer: object = "Paris"):
    return get_reward("exact")(RewardInput("prompt", completion, answer, {}))


def test_normalize():
    assert normalize("  The  Eiffel\n\tTower.  ") == "the eiffel tower"
    assert normalize("3.14") == "3.14"  # only a trailing '.' goes


@pytest.mark.parametrize(
    "completion", ["<answer>paris</answer>", "<answer> PARIS. </answer>", "Paris.", "  paris\n"]
)
def test_matches_after_normalisation(completion):
    out = score(completion)
    assert out.reward == 1.0 and out.components == {"answer_reward": 1.0} and out.reason == ""


@pytest.mark.parametrize(
    "completion", ["<answer>London</answer>", "It is Paris", "<answer></answer>", "", "Par is"]
)
def test_wrong_or_malformed_gets_zero(completion):
    out = score(completion)
    assert out.reward == 0.0 and out.reason == "answer does not match"


def test_last_answer_tag_wins_and_lists_accept_any():
    assert score("<answer>London</answer> no: <answer>Paris</answer>").reward == 1.0
    assert score("<answer>paris, france</answer>", ["Paris", "Paris, France"]).reward == 1.0


def test_adversarial_answers_are_only_compared():
    if os.path.exists("/tmp/pwned"):
        os.remove("/tmp/pwned")
    assert score("<answer>__import__('os').system('touch /tmp/pwned')</answer>").reward == 0.0
    assert score("<answer>9**9**9</answer>", "9**9**9").reward == 1.0  # strings, not numbers
    assert not os.path.exists("/tmp/pwned")
