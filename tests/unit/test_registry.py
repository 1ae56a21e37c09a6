"""LeastLoadedRegistry as a plain class (the Ray actor wraps exactly this)."""

import asyncio

import pytest

from async_grpo.inference.registry import LeastLoadedRegistry
from async_grpo.inference.types import PoolUnavailable


def test_least_loaded_worker_is_leased():
    async def run():
        reg = LeastLoadedRegistry("generation")
        await reg.register("a", "handle-a", capacity=8, version=0)
        await reg.register("b", "handle-b", capacity=4, version=0)
        leases = [await reg.lease(2, timeout_s=1) for _ in range(3)]
        # a: 0/8 -> b: 0/4 tie broken by load fraction; then a (2/8 = .25 < b 2/4 = .5)
        assert [wid for wid, _ in leases] == ["a", "b", "a"]
        status = {s.worker_id: s.load for s in await reg.status()}
        assert status == {"a": 4, "b": 2}
        await reg.release("a", 2)
        assert {s.worker_id: s.load for s in await reg.status()}["a"] == 2

    asyncio.run(run())


def test_never_fits_is_refused_at_once_and_busy_pool_waits():
    async def run():
        reg = LeastLoadedRegistry("generation")
        await reg.register("a", "h", capacity=4, version=0)
        with pytest.raises(PoolUnavailable, match="can never fit"):
            await reg.lease(5, timeout_s=10)
        await reg.lease(4, timeout_s=1)
        waiter = asyncio.ensure_future(reg.lease(2, timeout_s=5))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await reg.release("a", 4)
        assert (await waiter)[0] == "a"
        with pytest.raises(PoolUnavailable, match="all workers busy"):
            await reg.lease(4, timeout_s=0.1)

    asyncio.run(run())


def test_dead_and_silent_workers_are_dropped():
    async def run():
        reg = LeastLoadedRegistry("logprob", heartbeat_timeout_s=0.05)
        await reg.register("a", "h", capacity=4, version=0)
        await reg.register("v", "h", capacity=4, version=0, heartbeats=False)
        await asyncio.sleep(0.1)
        wid, _ = await reg.lease(1, timeout_s=1)  # "a" missed its heartbeat
        assert wid == "v" and "no heartbeat" in reg.dropped["a"]
        assert await reg.heartbeat("a", 0) is False  # told to register again
        await reg.drop("v", "died during logprobs")
        with pytest.raises(PoolUnavailable, match="no live workers"):
            await reg.lease(1, timeout_s=0.1)

    asyncio.run(run())


def test_late_joiner_gets_the_published_weights():
    async def run():
        reg = LeastLoadedRegistry("generation")
        assert await reg.register("a", "h", 4, version=0) is None
        await reg.publish_weights(5, ["ref"])
        assert await reg.register("b", "h", 4, version=0) == (5, ["ref"])
        assert await reg.register("c", "h", 4, version=5) is None  # already current

    asyncio.run(run())
