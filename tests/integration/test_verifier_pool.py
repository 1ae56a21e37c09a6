"""VerifierPool on a real (private, local) Ray instance: 2 actors x 2 scoring processes."""

import asyncio
import os
import signal
import time

import pytest
from _ray import my_processes

from async_grpo.config import VerifierConfig
from async_grpo.rewards import RewardInput
from async_grpo.rewards.pool import VerifierPool

pytestmark = pytest.mark.integration


def countdown_samples(n: int) -> list[RewardInput]:
    """Even i: a right equation (i + 3); odd i: a wrong one (i - 3)."""
    return [
        RewardInput(
            "p", f"<answer>{i}{'+-'[i % 2]}3</answer>", {"target": i + 3, "numbers": [i, 3]}
        )
        for i in range(n)
    ]


def expected(n: int) -> list[float]:
    return [1.1 if i % 2 == 0 else 0.1 for i in range(n)]


@pytest.fixture(scope="module")
def ray_local(cluster):
    import ray

    return ray


@pytest.fixture(scope="module")
def pool(ray_local):
    cfg = VerifierConfig(num_workers=2, rewards=["countdown"], timeout_s=5.0, max_concurrency=2)
    pool = VerifierPool.start(cfg, num_cpus=1)
    yield pool
    pool.shutdown()


def sandbox_pids() -> list[int]:
    return sorted(my_processes("_child_main"))


def test_two_workers_score_200_samples_and_stats_add_up(pool):
    before = pool.stats()
    outs = asyncio.run(pool.score(countdown_samples(200)))
    assert [round(o.reward, 6) for o in outs] == expected(200)
    assert outs[0].components == {
        "countdown": pytest.approx(1.1),
        "countdown/format_reward": 0.1,
        "countdown/answer_reward": 1.0,
    }
    after = pool.stats()
    assert after["verifier/scored"] - before["verifier/scored"] == 200
    assert after["verifier/timeouts"] == after["verifier/errors"] == 0


def test_concurrent_batches_are_spread_and_kept_in_order(pool):
    async def many() -> list[list]:
        return await asyncio.gather(*(pool.score(countdown_samples(n)) for n in (1, 7, 30)))

    for n, outs in zip((1, 7, 30), asyncio.run(many()), strict=True):
        assert [round(o.reward, 6) for o in outs] == expected(n)


def test_subprocesses_killed_from_outside_are_replaced(pool):
    pids = sandbox_pids()
    assert len(pids) == 4  # 2 actors x max_concurrency 2
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    before = pool.stats()
    outs = asyncio.run(pool.score(countdown_samples(200)))
    assert [round(o.reward, 6) for o in outs] == expected(200)
    after = pool.stats()
    assert after["verifier/restarts"] - before["verifier/restarts"] == 4
    assert after["verifier/errors"] == before["verifier/errors"]  # no sample was lost
    assert len(set(sandbox_pids()) - set(pids)) == 4


def started_pids(cfg: VerifierConfig) -> tuple[VerifierPool, set[int]]:
    existing = set(sandbox_pids())
    pool = VerifierPool.start(cfg, num_cpus=0)
    return pool, set(sandbox_pids()) - existing


def wait_gone(pids: set[int], timeout_s: float = 10.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while pids & set(sandbox_pids()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids & set(sandbox_pids())


@pytest.mark.parametrize("how", ["shutdown", "actor killed"])
def test_no_scoring_process_outlives_its_worker(ray_local, how):
    cfg = VerifierConfig(num_workers=1, rewards=["countdown"], max_concurrency=2)
    pool, mine = started_pids(cfg)
    assert len(mine) == 2
    if how == "shutdown":
        pool.shutdown()
    else:  # no close(): the children die with the actor (PDEATHSIG)
        ray_local.kill(pool._actors[0])
    assert wait_gone(mine) == set()


@pytest.mark.parametrize(
    "reward, reason",
    [
        ("broken", "error: KeyError"),
        ("hangs", "timeout"),
        ("segfaults", "error: scoring process died (code=-11)"),
        ("hogs_memory", "error: MemoryError"),
    ],
)
def test_a_broken_reward_scores_zero_with_its_reason(ray_local, reward, reason):
    """Through the verifier actor, as a run scores: every sample comes back, 0 with why.
    The timeout is short only where it is the reason: a reward that fails at once has 60 s
    to say so, as a loaded machine may need seconds (a 3 s timeout would read as "timeout")."""
    cfg = VerifierConfig(
        num_workers=1,
        rewards=[f"rewards_for_tests:{reward}"],
        timeout_s=3.0 if reason == "timeout" else 60.0,
        max_concurrency=2,
    )
    pool = VerifierPool.start(cfg, num_cpus=0)
    try:
        outs = asyncio.run(pool.score(countdown_samples(3)))
    finally:
        pool.shutdown()
    assert [o.reward for o in outs] == [0.0] * 3
    assert all(o.reason.startswith(reason) for o in outs), [o.reason for o in outs]
