"""The sandbox: hard timeouts, crashes and outside kills cost one sample, never capacity.

The subprocesses import this module to unpickle `scripted`, a reward whose behaviour
each sample picks through `metadata["mode"]`.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from async_grpo.rewards import RewardInput, RewardOutput
from async_grpo.rewards.countdown import countdown_reward
from async_grpo.rewards.sandbox import SandboxError, SandboxPool

TIMEOUT_S = 1.0
KILL_SLACK_S = 0.5  # SIGKILL and reaping, on a contended 2-core machine


def scripted(sample: RewardInput) -> RewardOutput | float:
    """Countdown, unless `metadata["mode"]` asks for misbehaviour."""
    mode = sample.metadata.get("mode", "ok")
    if mode == "sleep":
        time.sleep(sample.metadata.get("seconds", 1e6))
    elif mode == "exit":
        os._exit(3)
    elif mode == "raise":
        raise ValueError("scripted failure")
    elif mode == "pid":
        return float(os.getpid())
    elif mode == "memory":
        return float(len(bytearray(8 * 1024**3)))  # above RLIMIT_AS
    elif mode == "power":
        return float(9**9 ** sample.metadata["exponent"] % 7)  # a naive reward's blowup
    return countdown_reward(sample)


def countdown_samples(n: int) -> list[RewardInput]:
    """Half right (a+b), half wrong (a-b), all well formatted."""
    return [
        RewardInput(
            "p", f"<answer>{i}{'+-'[i % 2]}3</answer>", {"target": i + 3, "numbers": [i, 3]}
        )
        for i in range(n)
    ]


def odd(mode: str, **extra) -> RewardInput:
    return RewardInput("p", "", None, {"mode": mode, **extra})


def timed(pool: SandboxPool, sample: RewardInput) -> tuple[RewardOutput, float]:
    start = time.monotonic()
    out = pool.score(sample)
    return out, time.monotonic() - start


def assert_serves_correctly(pool: SandboxPool, n: int = 100) -> None:
    outs = [pool.score(s) for s in countdown_samples(n)]
    assert [o.reward for o in outs] == [1.1 if i % 2 == 0 else 0.1 for i in range(n)]


@pytest.fixture
def pool():
    pool = SandboxPool(scripted, num_procs=1, timeout_s=TIMEOUT_S)
    yield pool
    pool.close()


def test_scores_like_in_process(pool):
    samples = countdown_samples(10)
    assert [pool.score(s) for s in samples] == [countdown_reward(s) for s in samples]
    assert pool.stats() == {
        "verifier/timeouts": 0,
        "verifier/errors": 0,
        "verifier/scored": 10,
        "verifier/restarts": 0,
    }


def test_hang_is_killed_at_the_timeout_then_100_samples_are_served(pool):
    first_pid = pool.score(odd("pid")).reward
    out, elapsed = timed(pool, odd("sleep"))
    assert out == RewardOutput(0.0, {}, "timeout")
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + KILL_SLACK_S
    with pytest.raises(ProcessLookupError):
        os.kill(int(first_pid), 0)  # the hung process is gone
    assert_serves_correctly(pool)
    stats = pool.stats()
    assert (stats["verifier/timeouts"], stats["verifier/restarts"]) == (1, 1)
    assert stats["verifier/scored"] == 102


def test_exit_mid_sample_is_an_error_then_100_samples_are_served(pool):
    out, elapsed = timed(pool, odd("exit"))
    assert out.reward == 0.0 and out.reason == "error: scoring process died (code=3)"
    assert elapsed < TIMEOUT_S
    assert_serves_correctly(pool)
    assert pool.stats()["verifier/errors"] == 1


def test_sigkill_from_outside_mid_sample_then_100_samples_are_served(pool):
    pid = int(pool.score(odd("pid")).reward)
    threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
    out, elapsed = timed(pool, odd("sleep", seconds=0.9 * TIMEOUT_S))
    assert out.reason == f"error: scoring process died (code={-signal.SIGKILL})"
    assert elapsed < TIMEOUT_S
    assert_serves_correctly(pool)


def test_sigkill_while_idle_is_replaced_without_losing_a_sample(pool):
    """Each sample is sent the moment after the kill, before the process is seen dead:
    it died before taking the sample, so the sample goes to its replacement (before the
    child said "taken", each of these was lost as `scoring process died`)."""
    for _ in range(3):
        pid = int(pool.score(odd("pid")).reward)
        os.kill(pid, signal.SIGKILL)
        assert_serves_correctly(pool, n=10)
    stats = pool.stats()
    assert (stats["verifier/errors"], stats["verifier/restarts"]) == (0, 3)


def test_exception_is_an_error_and_the_process_is_kept(pool):
    pid = pool.score(odd("pid")).reward
    out = pool.score(odd("raise"))
    assert out == RewardOutput(0.0, {}, "error: ValueError: scripted failure")
    assert pool.score(odd("pid")).reward == pid
    assert pool.stats()["verifier/restarts"] == 0


@pytest.mark.parametrize("sample", [odd("memory"), odd("power", exponent=9)])
def test_memory_and_power_blowups_are_capped(pool, sample):
    # RLIMIT_AS (2 GiB) turns the allocation into MemoryError; 9**9**9 is cut by the
    # limit or the timeout, whichever comes first.
    out, elapsed = timed(pool, sample)
    assert out.reward == 0.0
    assert out.reason in ("timeout", "error: MemoryError: ")
    assert elapsed < TIMEOUT_S + KILL_SLACK_S
    assert_serves_correctly(pool, n=10)


def test_samples_run_concurrently_on_all_processes():
    pool = SandboxPool(scripted, num_procs=2, timeout_s=5.0)
    try:
        results: list[float] = []
        threads = [
            threading.Thread(
                target=lambda: results.append(timed(pool, odd("sleep", seconds=0.5))[1])
            )
            for _ in range(2)
        ]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert time.monotonic() - start < 0.9  # 2 x 0.5 s in parallel, not in series
        assert len(results) == 2
    finally:
        pool.close()


def test_close_kills_every_process():
    pool = SandboxPool(scripted, num_procs=2, timeout_s=TIMEOUT_S)
    pids = [w.proc.pid for w in pool._workers]
    pool.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_unpicklable_reward_fails_loud():
    with pytest.raises(SandboxError, match="cannot be sent to a subprocess"):
        SandboxPool(lambda sample: 1.0, num_procs=1, timeout_s=TIMEOUT_S)


def test_busy_child_dies_with_its_parent():
    # The parent is SIGKILLed while its child sleeps mid-sample (so the child never reads
    # EOF): PDEATHSIG must take the child down with it.
    code = textwrap.dedent("""
        from async_grpo.rewards.sandbox import SandboxPool
        from test_rewards_sandbox import odd, scripted
        pool = SandboxPool(scripted, num_procs=1, timeout_s=600)
        print(pool._workers[0].proc.pid, flush=True)
        pool.score(odd("sleep"))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
    child = psutil.Process(int(parent.stdout.readline()))
    time.sleep(0.5)
    assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
    parent.kill()
    parent.wait()
    gone, _ = psutil.wait_procs([child], timeout=5)
    assert gone or child.status() == psutil.STATUS_ZOMBIE


def test_unpicklable_sample_is_an_error_and_the_process_is_kept(pool):
    pid = pool.score(odd("pid")).reward
    out = pool.score(RewardInput("p", "", lambda: 24, {}))
    assert out.reward == 0.0 and out.reason.startswith("error: sample cannot be pickled")
    assert pool.score(odd("pid")).reward == pid
