"""Registry and workers on a real local Ray cluster, with real log-prob workers (tiny model):
published weights outlive their publisher, a worker survives weights it cannot fetch and
loads them when it registers again, and leases of cancelled or dead callers come back.

The tests share one cluster and one worker and run in file order."""

import asyncio
import os
import subprocess
import sys
import time

import pytest
import torch

from async_grpo.config import LogprobConfig
from async_grpo.ray_utils import NAMESPACE

pytestmark = pytest.mark.integration
GRACE_S = 5.0  # lease grace of this test's registry: unbacked leases return within ~7 s


@pytest.fixture(scope="module")
def cluster():
    import ray

    from async_grpo.inference.launch import ensure_registry
    from async_grpo.ray_utils import connect

    connect(None, num_cpus=4, object_store_bytes=256 << 20)
    ensure_registry("logprob", lease_grace_s=GRACE_S)  # first: later calls keep its settings
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def state(tiny_model_dir):
    from safetensors.torch import load_file

    return load_file(str(tiny_model_dir / "model.safetensors"))


def _driver(code: str) -> list:
    """Run `code` in a separate driver process on this cluster, which then exits (as a
    trainer does), and wait until Ray has noticed: returns `[ObjectRef]` of an object that
    driver put, now unreadable (OwnerDiedError). Objects an actor put stayed readable after
    ray.kill, and a driver's stay readable for a moment after it exits, hence the wait."""
    import ray
    from ray.exceptions import OwnerDiedError

    address = ray.get_runtime_context().gcs_address
    prelude = (
        "import ray, torch\n"
        "from safetensors.torch import load_file\n"
        f"ray.init(address={address!r}, namespace={NAMESPACE!r})\n"
    )
    canary = (
        "class Holder:\n"
        "    def set(self, ref): self.ref = ref\n"
        "    def get(self): return self.ref\n"
        "h = ray.remote(Holder).options(name='canary', lifetime='detached').remote()\n"
        "ray.get(h.set.remote([ray.put({'x': torch.ones(1 << 18)})]))\n"  # 1 MB: in the store
    )
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    r = subprocess.run(
        [sys.executable, "-c", prelude + code + canary],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    holder = ray.get_actor("canary", namespace=NAMESPACE)
    dead = ray.get(holder.get.remote(), timeout=60)
    ray.kill(holder)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(dead[0], timeout=10)
        except OwnerDiedError:
            return dead
        time.sleep(0.2)
    raise AssertionError("an object of an exited driver was still readable after 60s")


def _kill(actor) -> None:
    """ray.kill, then wait until the actor is really gone (ray.kill does not wait)."""
    import ray
    from ray.exceptions import RayActorError

    ray.kill(actor)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=10)
        except RayActorError:
            return
        time.sleep(0.2)
    raise AssertionError("a killed actor still answers after 60s")


def _marked(state, value):
    name = next(k for k in state if k.endswith("embed_tokens.weight"))
    return {**state, name: torch.full_like(state[name], value)}, name


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
    """One log-prob worker that joins after a publisher that has since exited published
    version 5: it must start and serve version 5 (not die with OwnerDiedError)."""

    from async_grpo.inference.launch import start_logprob_workers, stop_workers

    _driver(  # what trainer rank 0 does (trainer/push.py), then it exits
        "from async_grpo.trainer.push import WeightPusher\n"
        f"state = load_file({str(tiny_model_dir / 'model.safetensors')!r})\n"
        "WeightPusher(['logprob'], 'gloo')._publish(state, 5)\n"
    )
    (w,) = start_logprob_workers(str(tiny_model_dir), LogprobConfig(threads=1), 1, timeout_s=300)
    yield w
    stop_workers([w], drain_timeout_s=5)


def test_published_weights_outlive_their_publisher(worker):
    import ray

    ping = ray.get(worker.ping.remote(), timeout=60)
    assert ping["version"] == 5 and ping["weight_load_failures"] == 0


def test_worker_survives_weights_it_cannot_fetch(worker, state):
    import ray

    lost = _driver("")
    assert ray.get(worker.load_published.remote((6, lost)), timeout=120) is False
    ping = ray.get(worker.ping.remote(), timeout=60)
    assert ping["version"] == 5 and ping["weight_load_failures"] == 1
    out = ray.get(worker.logprobs.remote([([1, 2, 3], [4, 5])]), timeout=120)
    assert len(out[0]) == 2  # still serving


def test_dropped_worker_loads_published_weights_when_it_registers_again(worker, state):
    """Dropped, it missed a push; its heartbeat registers it again and it loads version 7."""
    import ray

    registry = _registry()
    wid = ray.get(worker.ping.remote())["worker_id"]
    # published while the worker misses it (a push reaches registered workers only), then
    # the worker is dropped: registering again, it must load version 7
    ray.get(registry.publish_weights.remote(7, [ray.put(_marked(state, 0.25)[0])]), timeout=120)
    ray.get(registry.drop.remote(wid, "test: dropped"))
    _wait_for("version 7", lambda: ray.get(worker.ping.remote())["version"] == 7)
    status = ray.get(registry.status.remote())
    assert [(s.worker_id, s.version) for s in status] == [(wid, 7)]


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
    _wait_for("the dead caller's lease back", lambda: _load() == 0, 30)
    print(f"reclaimed after {time.monotonic() - t:.1f}s (grace {GRACE_S}s)")


def test_dead_worker_without_heartbeats_is_dropped(cluster):
    """A verifier of a run that crashed (no heartbeats, never deregistered) is found dead by
    the registry's probe and dropped, so no caller is leased a dead actor."""
    import ray

    from async_grpo.inference.launch import ensure_registry

    class Silent:
        def ping(self):
            return {}

    registry = ensure_registry("verifier")
    actor = ray.remote(Silent).remote()
    ray.get(registry.register.remote("verify-x-0", actor, 8, 0, "", False), timeout=60)
    _kill(actor)
    t = time.monotonic()
    _wait_for("the dead verifier dropped", lambda: not ray.get(registry.status.remote()), 40)
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
