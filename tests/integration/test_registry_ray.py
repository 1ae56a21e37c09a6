"""Registry and workers on a real local Ray cluster, with a real log-prob worker (tiny
model): leases of cancelled or dead callers come back, dead workers are dropped.

The tests share one cluster and one worker and run in file order."""

import asyncio
import time

import pytest
from _ray import forget_pools, seconds_until_dead

from async_grpo.config import LogprobConfig

pytestmark = pytest.mark.integration
# lease grace of this test's registry: long enough to see a lease before it is reclaimed
# on a busy machine (2 test workers on 2 cores), short enough to wait for the reclaim
GRACE_S = 15.0


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    from async_grpo.pools import ensure_registry

    forget_pools()  # this module's registry must be made with its grace
    ensure_registry("logprob", lease_grace_s=GRACE_S)
    yield
    forget_pools()


def _kill(actor) -> None:
    """ray.kill, then wait until the actor is really gone (ray.kill does not wait)."""
    import ray

    ray.kill(actor)
    seconds_until_dead(actor, 60, "a killed actor")


def _registry():
    from async_grpo.inference.client import get_registry

    return get_registry("logprob")


def _wait_for(what, predicate, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what} not within {timeout_s}s"
        time.sleep(0.25)
    return value


@pytest.fixture(scope="module")
def worker(cluster, tiny_model_dir):
    from async_grpo.pools import start_logprob_workers, stop_workers

    (w,) = start_logprob_workers(str(tiny_model_dir), LogprobConfig(threads=1), 1, timeout_s=300)
    yield w
    stop_workers([w], drain_timeout_s=5)


def _load():
    import ray

    return sum(s.load for s in ray.get(_registry().status.remote()))


def test_cancelled_callers_release_their_leases(worker):
    """A caller cancelled while it waits for a lease, or while the worker answers, leaves no
    load behind; the next caller can lease the whole worker."""
    import ray

    from async_grpo.inference.client import PoolClient

    registry = _registry()
    capacity = ray.get(registry.status.remote())[0].capacity
    client = PoolClient("logprob", lease_timeout_s=60, call_timeout_s=60)

    async def run():
        lease_id, _, _ = await registry.lease.remote(capacity, 10)  # the worker is full
        waiting = asyncio.ensure_future(client.call(1, "logprobs", [([1, 2], [3])]))
        await asyncio.sleep(1.0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await registry.release.remote(lease_id)
        # a request cancelled in flight: 64 pairs keep the worker busy for a while
        pairs = [(list(range(1, 200)), list(range(200, 400)))] * 64
        busy = asyncio.ensure_future(client.call(64, "logprobs", pairs))
        await asyncio.sleep(1.0)
        busy.cancel()
        with pytest.raises(asyncio.CancelledError):
            await busy

    asyncio.run(run())
    assert _load() == 0
    _wait_for("in_flight 0", lambda: ray.get(worker.ping.remote())["in_flight"] == 0, 120)
    lease_id, _, _ = ray.get(registry.lease.remote(capacity, 10), timeout=30)
    ray.get(registry.release.remote(lease_id))
    assert client.cancelled == 1


def test_lease_of_a_dead_caller_is_reclaimed(worker):
    """A caller that dies holding a lease (a crashed run): the worker's heartbeat shows no
    request behind it, so the registry takes it back after the grace period."""
    import ray

    class Caller:
        def take(self, n):
            from async_grpo.inference.client import get_registry

            return ray.get(get_registry("logprob").lease.remote(n, 10))[1]

    caller = ray.remote(Caller).remote()
    ray.get(caller.take.remote(200), timeout=60)
    assert _load() == 200  # (checked within the grace period)
    _kill(caller)
    t = time.monotonic()
    _wait_for("the dead caller's lease back", lambda: _load() == 0, 3 * GRACE_S)
    print(f"reclaimed after {time.monotonic() - t:.1f}s (grace {GRACE_S}s)")


def test_dead_worker_without_heartbeats_is_dropped(cluster):
    """A verifier of a run that crashed (no heartbeats, never deregistered) is found dead by
    the registry's probe and dropped, so no caller is leased a dead actor."""
    import ray

    from async_grpo.pools import ensure_registry

    class Silent:
        def ping(self):
            return {}

    # probed every heartbeat_timeout_s / 3: 1 s here (the default's 10 s was most of this
    # test's time); the first verifier registry of the module, so made with it
    registry = ensure_registry("verifier", heartbeat_timeout_s=3.0)
    actor = ray.remote(Silent).remote()
    ray.get(registry.register.remote("verify-x-0", actor, 8, 0, "", False), timeout=60)
    _kill(actor)
    t = time.monotonic()
    _wait_for("the dead verifier dropped", lambda: not ray.get(registry.status.remote()), 30)
    print(f"dropped after {time.monotonic() - t:.1f}s")


def test_async_registry_wait_leaves_the_event_loop_free(cluster):
    """Workers and the batcher look registries up from async code: the wait must not block
    the loop, and it ends with a line naming the pool."""
    from async_grpo.inference.client import get_registry_async
    from async_grpo.inference.types import PoolUnavailable

    ticks = []

    async def run():
        async def tick():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.1)

        ticker = asyncio.ensure_future(tick())
        try:
            with pytest.raises(PoolUnavailable, match="no registry for pool 'nowhere' after 2s"):
                await get_registry_async("nowhere", timeout_s=2)
        finally:
            ticker.cancel()

    asyncio.run(run())
    assert len(ticks) >= 10  # the loop kept running through the 2 s wait


def test_a_verifier_with_other_rewards_stops_the_start(cluster):
    """A verifier started without the run's config scores with its defaults; the trainer's
    start-up check names both reward specs instead of training on all-zero rewards."""
    from async_grpo.config import ConfigError, VerifierConfig
    from async_grpo.pools import start_verifier_workers, stop_workers
    from async_grpo.rewards.pool import check_verifiers

    workers = start_verifier_workers(VerifierConfig(), 1)  # defaults: countdown
    try:
        with pytest.raises(ConfigError) as e:
            check_verifiers(VerifierConfig(rewards=["last_number"]))
        assert "works by 'countdown combined by sum', this run by 'last_number" in str(e.value)
        assert check_verifiers(VerifierConfig()) == 1
    finally:
        stop_workers(workers, drain_timeout_s=5)
