"""A generation worker never outlives its engine: real vLLM workers with the tiny model.

- The engine-core process is killed (SIGKILL, as the OOM killer sends), not the actor: a
  request in flight is sent again to the other worker and completes, and the actor whose
  engine died ends, so Ray reports it dead (what `async-grpo run`'s supervisor replaces).
- A chunk that fails inside the engine ends vLLM's update session; the push started over
  on that worker opens it again (it used to fail: finish without a matching start).
- A push that stops arriving mid-update (the trainer died): the worker, its weights half
  loaded, ends its process instead of staying alive out of the pool.
"""

import asyncio
import os
import signal

import pytest
from _ray import seconds_until_dead
from test_generation_cancel import CFG  # one real engine config for the tiny model

from async_grpo.inference.types import SamplingSettings

pytestmark = pytest.mark.integration


def _engine_core(worker) -> int:
    """The pid of the worker's vLLM engine-core process (a child of the actor's)."""
    import psutil
    import ray

    actor_pid = ray.get(worker.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    (core,) = [
        p for p in psutil.Process(actor_pid).children(recursive=True) if "EngineCore" in p.name()
    ]
    return core.pid


def _ends_within(worker, timeout_s: float) -> float:
    """Seconds until Ray reports `worker` dead (it must be within `timeout_s`)."""
    return seconds_until_dead(worker, timeout_s, "the worker")


async def _until_its_engine_runs_a_request(worker, timeout_s: float) -> None:
    """Return once `worker`'s engine holds a request (its `ping`, every 0.1 s)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not (await worker.ping.remote())["engine_requests"]:
        assert asyncio.get_running_loop().time() < deadline, (
            f"no request reached the worker's engine within {timeout_s:.0f}s"
        )
        await asyncio.sleep(0.1)


def test_a_dead_engine_ends_its_worker_and_requests_go_elsewhere(cluster, tiny_model_dir):
    import ray

    from async_grpo.inference.client import PoolClient
    from async_grpo.pools import start_generation_workers, stop_workers

    workers = start_generation_workers(str(tiny_model_dir), CFG, 2, timeout_s=600)
    try:
        names = ray.get([w.ping.remote() for w in workers], timeout=60)
        first, second = workers
        core = _engine_core(first)
        client = PoolClient("generation", lease_timeout_s=120)
        retried = []

        async def two_calls_then_kill():
            # 8 sequences of up to 300 tokens: seconds of decoding after the kill, so the
            # first worker's request is still running when its engine dies
            long = SamplingSettings(max_new_tokens=300, temperature=1.0, seed=0)
            calls = [
                asyncio.ensure_future(
                    client.call(
                        8, "generate", [1, 2, 3], 8, long, on_retry=lambda: retried.append(1)
                    )
                )
                for _ in range(2)
            ]
            await _until_its_engine_runs_a_request(first, 120)
            os.kill(core, signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*calls), timeout=300)

        done = asyncio.run(two_calls_then_kill())
        assert all(len(out) == 8 for out in done)
        assert retried, "no request was on the worker whose engine died"
        took = _ends_within(first, 30)
        print(f"worker {names[0]['worker_id']} ended {took:.1f}s after its engine")
        # a chunk that fails inside the engine (here: no transfer engine set up, as a
        # broadcast whose sender's group broke) ends vLLM's update session; the push
        # started over on this worker opens it again and finishes
        ray.get(second.begin_update.remote(1, 120.0, 0), timeout=60)
        with pytest.raises(ray.exceptions.RayTaskError, match="before init_weight_transfer"):
            ray.get(second.load_chunk.remote(0, [], 0, 0, 0), timeout=60)
        ray.get(second.begin_update.remote(1, 120.0, 1), timeout=60)
        assert ray.get(second.end_update.remote(1), timeout=60)["version"] == 1
        # the trainer vanishes in the middle of a push: nothing after begin_update
        ray.get(second.begin_update.remote(2, 2.0), timeout=60)
        took = _ends_within(second, 30)
        print(f"abandoned push: worker ended {took:.1f}s after the push's timeout began")
    finally:
        stop_workers(workers, drain_timeout_s=5)
