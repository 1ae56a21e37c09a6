"""LeastLoadedRegistry as a plain class (the Ray actor wraps exactly this)."""

import asyncio

import pytest

from async_grpo.inference.registry import LeastLoadedRegistry
from async_grpo.inference.types import PoolUnavailable
from async_grpo.pools import worker_ids


def _loads(statuses):
    return {s.worker_id: s.load for s in statuses}


def test_least_loaded_worker_is_leased():
    async def run():
        reg = LeastLoadedRegistry("generation")
        await reg.register("a", "handle-a", capacity=8, version=0)
        await reg.register("b", "handle-b", capacity=4, version=0)
        leases = [await reg.lease(2, timeout_s=1) for _ in range(3)]
        # a: 0/8 -> b: 0/4 tie broken by load fraction; then a (2/8 = .25 < b 2/4 = .5)
        assert [wid for _, wid, _ in leases] == ["a", "b", "a"]
        assert [h for *_, h in leases] == ["handle-a", "handle-b", "handle-a"]
        assert _loads(await reg.status()) == {"a": 4, "b": 2}
        await reg.release(leases[0][0])
        assert _loads(await reg.status()) == {"a": 2, "b": 2}

    asyncio.run(run())


def test_release_is_by_id_and_idempotent():
    async def run():
        reg = LeastLoadedRegistry("generation")
        await reg.register("a", "h", capacity=4, version=0)
        first, _, _ = await reg.lease(3, timeout_s=1)
        second, _, _ = await reg.lease(1, timeout_s=1)
        await reg.release(first)
        await reg.release(first)  # twice: the second is a no-op, not a second 3 off
        assert _loads(await reg.status()) == {"a": 1}
        await reg.release(second)
        await reg.release("never-granted")
        assert _loads(await reg.status()) == {"a": 0}

    asyncio.run(run())


def test_never_fits_is_refused_at_once_and_busy_pool_waits():
    async def run():
        reg = LeastLoadedRegistry("generation")
        await reg.register("a", "h", capacity=4, version=0)
        with pytest.raises(PoolUnavailable, match="can never fit"):
            await reg.lease(5, timeout_s=10)
        full, _, _ = await reg.lease(4, timeout_s=1)
        waiter = asyncio.ensure_future(reg.lease(2, timeout_s=5))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await reg.release(full)
        assert (await waiter)[1] == "a"
        with pytest.raises(PoolUnavailable, match="all workers busy"):
            await reg.lease(4, timeout_s=0.1)

    asyncio.run(run())


def test_expired_lease_is_reclaimed():
    """A caller that never releases (its run crashed) holds capacity only until expiry."""

    async def run():
        reg = LeastLoadedRegistry("generation")
        await reg.register("a", "h", capacity=4, version=0)
        await reg.lease(4, timeout_s=1, hold_s=0.05)  # never released
        assert _loads(await reg.status()) == {"a": 4}
        await asyncio.sleep(0.1)
        assert _loads(await reg.status()) == {"a": 0}  # status reclaims too
        await reg.lease(4, timeout_s=1, hold_s=0.05)
        await asyncio.sleep(0.1)
        assert (await reg.lease(4, timeout_s=1))[1] == "a"  # the next caller gets all of it
        assert reg.reclaimed["expired"] == 2

    asyncio.run(run())


def test_heartbeat_in_flight_reclaims_unbacked_leases_oldest_first():
    """Leases older than the grace period that the worker's own in-flight count does not
    back are taken back; younger leases are left alone (their request may not have
    reached the worker yet)."""

    async def run():
        reg = LeastLoadedRegistry("generation", lease_grace_s=0.05)
        await reg.register("a", "h", capacity=8, version=0)
        await reg.register("b", "h2", capacity=8, version=0)
        oldest, _, _ = await reg.lease(2, timeout_s=1)  # a
        await reg.lease(2, timeout_s=1)  # b
        await asyncio.sleep(0.01)
        kept, wid, _ = await reg.lease(3, timeout_s=1)  # a (2/8 == 2/8, "a" < "b")
        assert wid == "a"
        await asyncio.sleep(0.1)
        young, _, _ = await reg.lease(1, timeout_s=1)  # b: 2/8 < 5/8
        assert _loads(await reg.status()) == {"a": 5, "b": 3}
        # a serves 3 sequences: 5 leased on it, so the oldest lease (2) has no request
        assert await reg.heartbeat("a", 0, in_flight=3) is True
        assert _loads(await reg.status()) == {"a": 3, "b": 3}
        await reg.release(oldest)  # the late release of a reclaimed lease changes nothing
        assert _loads(await reg.status()) == {"a": 3, "b": 3}
        # b serves nothing: its old lease goes, the young one (within grace) stays
        await reg.heartbeat("b", 0, in_flight=0)
        assert _loads(await reg.status()) == {"a": 3, "b": 1}
        assert reg.reclaimed["unbacked"] == 2
        await reg.heartbeat("a", 0)  # no count reported: nothing reclaimed
        await reg.release(kept)
        await reg.release(young)
        assert _loads(await reg.status()) == {"a": 0, "b": 0}

    asyncio.run(run())


def test_lease_released_before_its_grant_is_never_granted():
    """A caller cancelled while waiting releases a lease id it never saw granted."""

    async def run():
        reg = LeastLoadedRegistry("generation")
        await reg.register("a", "h", capacity=4, version=0)
        full, _, _ = await reg.lease(4, timeout_s=1)
        waiter = asyncio.ensure_future(reg.lease(4, timeout_s=5, lease_id="gone"))
        await asyncio.sleep(0.05)
        await reg.release("gone")
        with pytest.raises(PoolUnavailable, match="lease gone was cancelled"):
            await waiter
        await reg.release(full)
        assert _loads(await reg.status()) == {"a": 0}
        assert (await reg.lease(4, timeout_s=1))[1] == "a"

    asyncio.run(run())


def test_dead_and_silent_workers_are_dropped():
    async def run():
        reg = LeastLoadedRegistry("logprob", heartbeat_timeout_s=0.05)
        await reg.register("a", "h", capacity=4, version=0)
        b = "10.0.0.7 node 3f2a9b1c (gpu-b)"  # as the worker names its node
        await reg.register("v", "h", capacity=4, version=0, node=b, heartbeats=False)
        await asyncio.sleep(0.1)
        _, wid, _ = await reg.lease(1, timeout_s=1)  # "a" missed its heartbeat
        assert wid == "v" and "no heartbeat" in reg.dropped["a"]
        assert await reg.heartbeat("a", 0) is False  # told to register again
        await reg.drop("v", "died during logprobs")
        assert (await reg.lost())["v"] == f"died during logprobs (node {b})"
        with pytest.raises(PoolUnavailable, match=r"no live workers.*\(node 10.0.0.7 node 3f2a"):
            await reg.lease(1, timeout_s=0.1)

    asyncio.run(run())


def test_duplicate_worker_id_from_another_actor_is_refused():
    async def run():
        reg = LeastLoadedRegistry("generation")
        await reg.register("gen-1", "actor-A", capacity=4, version=0, node="n1")
        lid, _, _ = await reg.lease(3, timeout_s=1)
        with pytest.raises(ValueError, match="'gen-1' is already registered by another actor"):
            await reg.register("gen-1", "actor-B", capacity=4, version=0, node="n2")
        assert await reg.handles() == {"gen-1": "actor-A"}
        # the same actor registering again (from its heartbeat) is fine; its lease stays
        await reg.register("gen-1", "actor-A", capacity=4, version=2, node="n1")
        assert [(s.load, s.version) for s in await reg.status()] == [(3, 2)]
        await reg.release(lid)
        # once it is gone, the id is free again
        await reg.deregister("gen-1")
        await reg.register("gen-1", "actor-B", capacity=4, version=0)

    asyncio.run(run())


def test_launcher_deregisters_the_workers_it_stopped_by_handle():
    """Verifier workers never deregister themselves (and have no heartbeat to expire)."""

    async def run():
        reg = LeastLoadedRegistry("verifier")
        await reg.register("v1", "actor-1", 8, 0, heartbeats=False)
        await reg.register("v2", "actor-2", 8, 0, heartbeats=False)
        await reg.lease(2, timeout_s=1)
        assert await reg.deregister_handles(["actor-1", "actor-9"]) == ["v1"]
        assert list(await reg.handles()) == ["v2"]

    asyncio.run(run())


def test_worker_ids_are_unique_within_one_second():
    a, b = worker_ids("gen", 2), worker_ids("gen", 2)
    assert len(set(a + b)) == 4
    assert all(w.startswith("gen-") for w in a) and a[1].endswith("-1")


def test_late_joiner_gets_the_newest_checkpoint():
    async def run():
        reg = LeastLoadedRegistry("generation")
        assert await reg.register("a", "h", 4, version=0) is None
        await reg.announce_checkpoint(5, "/out/checkpoints/step_5/hf")
        await reg.announce_checkpoint(3, "/out/checkpoints/step_3/hf")  # late, older: ignored
        assert await reg.register("b", "h", 4, version=0) == (5, "/out/checkpoints/step_5/hf")
        assert await reg.register("c", "h", 4, version=5) is None  # already current
        await reg.announce_checkpoint(0, None)  # a new run starts: its versions count anew
        assert await reg.register("d", "h", 4, version=0) is None

    asyncio.run(run())


def test_a_worker_behind_the_needed_version_is_not_leased_until_it_catches_up():
    """A replacement serving version 0 is idle (least loaded) but behind version 3: it is
    passed over; with nothing else, the lease waits until its heartbeat reports version 3,
    and a lease that times out says the workers were behind."""

    async def run():
        reg = LeastLoadedRegistry("generation")
        await reg.register("old", "h-old", capacity=8, version=3)
        await reg.register("new", "h-new", capacity=8, version=0)
        busy, wid, _ = await reg.lease(6, timeout_s=1, min_version=3)
        assert wid == "old"
        _, wid, _ = await reg.lease(2, timeout_s=1, min_version=3)
        assert wid == "old"  # 8/8 now, though "new" has all its room
        with pytest.raises(PoolUnavailable, match=r"1 worker\(s\) behind version 3"):
            await reg.lease(2, timeout_s=0.1, min_version=3)
        assert (await reg.lease(2, timeout_s=1, min_version=0))[1] == "new"
        waiter = asyncio.ensure_future(reg.lease(2, timeout_s=5, min_version=3))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await reg.heartbeat("new", 3, in_flight=2)  # the catch-up push reached it
        assert (await waiter)[1] == "new"

    asyncio.run(run())


def test_a_background_lease_yields_to_every_waiting_training_lease():
    """Evaluation leases in the background: while a training lease waits for room, a
    background one is not granted even where it would fit; it goes once none waits."""

    async def run():
        reg = LeastLoadedRegistry("generation")
        await reg.register("a", "h", capacity=4, version=0)
        full, _, _ = await reg.lease(4, timeout_s=1)
        evaluation = asyncio.ensure_future(reg.lease(1, timeout_s=5, background=True))
        await asyncio.sleep(0.05)
        training = asyncio.ensure_future(reg.lease(3, timeout_s=5))  # asks after evaluation
        await asyncio.sleep(0.05)
        await reg.release(full)  # room for both, but training goes first
        trained, _, _ = await training
        assert _loads(await reg.status()) == {"a": 3}
        granted, _, _ = await asyncio.wait_for(evaluation, 2)  # none waits now: it fits
        assert _loads(await reg.status()) == {"a": 4}
        # with a training lease waiting for room, background is refused even with room left
        await reg.release(granted)
        blocked = asyncio.ensure_future(reg.lease(4, timeout_s=5))  # needs all 4: waits
        await asyncio.sleep(0.05)
        with pytest.raises(PoolUnavailable, match="background lease waits"):
            await reg.lease(1, timeout_s=0.2, background=True)
        await reg.release(trained)
        await asyncio.wait_for(blocked, 2)

    asyncio.run(run())


def test_a_training_lease_waiting_for_a_push_does_not_hold_back_a_background_one():
    """A lease for a version no worker serves yet waits for a push; the push may itself
    wait for an evaluation, so an evaluation lease must still be granted meanwhile."""

    async def run():
        reg = LeastLoadedRegistry("generation")
        await reg.register("a", "h", capacity=4, version=0)
        next_version = asyncio.ensure_future(reg.lease(2, timeout_s=5, min_version=1))
        await asyncio.sleep(0.05)
        granted, _, _ = await asyncio.wait_for(reg.lease(1, timeout_s=1, background=True), 2)
        assert not next_version.done()
        await reg.release(granted)
        await reg.heartbeat("a", version=1)  # the push: version 1 served
        await asyncio.wait_for(next_version, 2)

    asyncio.run(run())
