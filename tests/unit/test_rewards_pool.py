"""VerifierWorker without Ray: configured rewards, combined, on hostile completions."""

import asyncio
import os
import time

import pytest
from test_rewards_sandbox import countdown_samples, odd

from async_grpo.config import VerifierConfig
from async_grpo.errors import UserError
from async_grpo.rewards import RewardInput
from async_grpo.rewards.pool import VerifierWorker

TIMEOUT_S = 2.0
COUNTDOWN = {"target": 24, "numbers": [4, 6, 1]}
HOSTILE = {
    "import os": "<answer>__import__('os').system('touch /tmp/pwned')</answer>",
    "boxed import os": r"\boxed{__import__('os').system('touch /tmp/pwned')}",
    "9**9**9": "<answer>9**9**9</answer>",
    "boxed 9^9^9": r"\boxed{9^{9^{9}}}",
    "2**2**2**2**2": r"<answer>2**2**2**2**2</answer> \boxed{2**2**2**2**2}",
    "reused": "<answer>4*6*1*1</answer>",
    "missing": "<answer>4*6</answer>",
    "division by zero": r"<answer>4*6*1/(1-1)</answer> \boxed{1/0}",
    "50k latex": r"\boxed{" + r"\sqrt{2}" * 6_250 + "}",
    "10k parens": "<answer>" + "(" * 10_000 + "4*6*1" + ")" * 10_000 + "</answer>",
    "10k parens boxed": r"\boxed{" + "(" * 10_000 + "1" + ")" * 10_000 + "}",
}


@pytest.fixture(scope="module")
def worker():
    cfg = VerifierConfig(rewards=["countdown", "math"], timeout_s=TIMEOUT_S, max_concurrency=2)
    worker = VerifierWorker(cfg)
    yield worker
    worker.close()


def test_combines_configured_rewards_by_sum(worker):
    # countdown: format 0.1 + answer 1.0; math reads a string answer, and str(dict) is
    # no number: 0. Sum: 1.1.
    sample = RewardInput("p", r"<think>\boxed{24}</think><answer>4*6*1</answer>", COUNTDOWN)
    (out,) = asyncio.run(worker.score([sample]))
    assert out.reward == pytest.approx(1.1)
    assert out.components == {
        "countdown": pytest.approx(1.1),
        "countdown/format_reward": 0.1,
        "countdown/answer_reward": 1.0,
        "math": 0.0,
        "math/answer_reward": 0.0,
    }
    assert out.reason == "math: answer does not match"


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_completion_scores_zero_within_the_timeout(worker, name):
    if os.path.exists("/tmp/pwned"):
        os.remove("/tmp/pwned")
    sample = RewardInput("p", HOSTILE[name], COUNTDOWN)
    start = time.monotonic()
    (out,) = asyncio.run(worker.score([sample]))
    assert time.monotonic() - start < TIMEOUT_S + 0.5
    assert out.components.get("countdown/answer_reward", 0.0) == 0.0
    assert out.components.get("math", 0.0) == 0.0
    assert not os.path.exists("/tmp/pwned")


def test_kills_mid_batch_cost_one_sample_each_and_capacity_survives():
    cfg = VerifierConfig(
        rewards=["test_rewards_sandbox:scripted"], timeout_s=1.0, max_concurrency=2
    )
    worker = VerifierWorker(cfg)
    try:
        batch = [odd("sleep"), odd("exit"), *countdown_samples(100)]
        outs = asyncio.run(worker.score(batch))
        assert outs[0].reason == "timeout"
        assert outs[1].reason.startswith("error: scoring process died")
        assert [o.reward for o in outs[2:]] == [1.1 if i % 2 == 0 else 0.1 for i in range(100)]
        again = asyncio.run(worker.score(countdown_samples(100)))
        assert sum(o.reward == 1.1 for o in again) == 50
        assert worker.stats() == {
            "verifier/timeouts": 1,
            "verifier/errors": 1,
            "verifier/scored": 202,
            "verifier/restarts": 2,
        }
    finally:
        worker.close()


def test_bad_reward_name_fails_before_any_process_starts():
    with pytest.raises(UserError, match="known rewards"):
        VerifierWorker(VerifierConfig(rewards=["countdwn"]))
