"""A generation call that times out or is cancelled stops in the vLLM engine too (no ghost
work), and its lease is released: one real vLLM worker with the tiny random model."""

import asyncio
import time

import pytest
from _cli import TINY_KV_GIB

from async_grpo.config import GenerationConfig
from async_grpo.inference.types import SamplingSettings

pytestmark = pytest.mark.integration

CFG = GenerationConfig(
    max_model_len=2048,
    max_new_tokens=16,
    max_concurrent_seqs=16,
    kv_cache_gib=TINY_KV_GIB,
    threads=1,
    dtype="float32",
)
N = 16
LONG = SamplingSettings(max_new_tokens=2000, temperature=1.0, seed=0)


@pytest.fixture(scope="module")
def worker(cluster, tiny_model_dir):
    import ray

    from async_grpo.pools import start_generation_workers, stop_workers

    (w,) = start_generation_workers(str(tiny_model_dir), CFG, 1, timeout_s=600)
    ray.get(w.generate.remote([1, 2, 3], N, SamplingSettings(32, 1.0, seed=1)), timeout=300)
    yield w
    stop_workers([w], drain_timeout_s=5)


@pytest.fixture(scope="module")
def natural_s(worker) -> float:
    """Seconds the LONG request would take to finish by itself, from this machine's speed
    (N sequences x 64 tokens); an abort must leave the engine idle far sooner."""
    import ray

    t = time.monotonic()
    out = ray.get(worker.generate.remote([7, 8, 9], N, SamplingSettings(64, 1.0, seed=2)))
    speed = sum(len(c.token_ids) for c in out) / (time.monotonic() - t)
    print(f"{speed:.0f} tok/s: the long request needs ~{N * 2000 / speed:.0f}s")
    return N * 2000 / speed


def _wait_idle(worker, timeout_s: float) -> float:
    import ray

    t = time.monotonic()
    while (p := ray.get(worker.ping.remote(), timeout=30))["engine_requests"] or p["in_flight"]:
        assert time.monotonic() - t < timeout_s, f"engine still busy: {p}"
        time.sleep(0.1)
    return time.monotonic() - t


def _load() -> int:
    import ray

    from async_grpo.inference.client import get_registry

    return sum(s.load for s in ray.get(get_registry("generation").status.remote()))


def test_timed_out_call_is_aborted_in_the_engine(worker, natural_s):
    import ray

    from async_grpo.inference.client import PoolClient

    client = PoolClient("generation", lease_timeout_s=60, call_timeout_s=3)
    busy_before = {}

    async def run():
        call = asyncio.ensure_future(client.call(N, "generate", [1, 2, 3], N, LONG))
        await asyncio.sleep(2)
        busy_before.update(await worker.ping.remote())
        await call

    with pytest.raises(TimeoutError, match="did not answer generate within 3s"):
        asyncio.run(run())
    assert busy_before["engine_requests"] >= 1 and busy_before["in_flight"] == N
    print(f"engine idle {_wait_idle(worker, natural_s / 4):.1f}s after the timeout")
    assert _load() == 0 and client.cancelled == 1
    out = ray.get(worker.generate.remote([1, 2, 3], 1), timeout=120)
    assert len(out[0].token_ids) > 0  # the engine serves on


def test_cancelled_caller_aborts_its_request(worker, natural_s):
    from async_grpo.inference.client import PoolClient

    client = PoolClient("generation", lease_timeout_s=60, call_timeout_s=600)

    async def run():
        call = asyncio.ensure_future(client.call(N, "generate", [4, 5, 6], N, LONG))
        await asyncio.sleep(2)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(run())
    print(f"engine idle {_wait_idle(worker, natural_s / 4):.1f}s after the cancel")
    assert _load() == 0 and client.cancelled == 1
