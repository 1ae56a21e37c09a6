"""PoolClient: lease a worker from a pool's registry, call it directly, retry on death.

A dead worker (RayActorError) is dropped from the registry and the request is retried on
another worker, at most `max_retries` times. A `RequestError` (bad input) fails alone and
is not retried. Every wait is bounded and says what it waited for.
"""

from __future__ import annotations

import asyncio
from typing import Any

from async_grpo.inference.types import PoolUnavailable
from async_grpo.ray_utils import NAMESPACE, registry_name


def get_registry(pool: str, timeout_s: float = 60.0) -> Any:
    """The named registry actor of `pool`, waiting for it to appear."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(registry_name(pool), namespace=NAMESPACE)
        except ValueError:
            if time.monotonic() > deadline:
                raise PoolUnavailable(
                    f"no registry for pool {pool!r} after {timeout_s:.0f}s:"
                    f" start workers with `async-grpo worker --mode {pool}`"
                ) from None
            time.sleep(0.5)


class PoolClient:
    """Calls `method` on the least-loaded worker of a pool with room for `n` sequences."""

    def __init__(
        self,
        pool: str,
        registry: Any = None,
        lease_timeout_s: float = 600.0,
        call_timeout_s: float = 1800.0,
        max_retries: int = 3,
    ) -> None:
        self.pool = pool
        self.registry = registry if registry is not None else get_registry(pool)
        self.lease_timeout_s = lease_timeout_s
        self.call_timeout_s = call_timeout_s
        self.max_retries = max_retries
        self.retries = 0  # requests moved to another worker after a death (a metric)

    async def call(self, n: int, method: str, *args: Any, **kwargs: Any) -> Any:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        last: Exception | None = None
        for _ in range(self.max_retries + 1):
            worker_id, handle = await self.registry.lease.remote(n, self.lease_timeout_s)
            try:
                ref = getattr(handle, method).remote(*args, **kwargs)
                return await asyncio.wait_for(ref, timeout=self.call_timeout_s)
            except (RayActorError, ActorDiedError, ActorUnavailableError) as e:
                last = e
                self.retries += 1
                await self.registry.drop.remote(
                    worker_id, f"died during {method}: {type(e).__name__}"
                )
            except TimeoutError:
                raise TimeoutError(
                    f"pool {self.pool!r}: worker {worker_id} did not answer {method} within"
                    f" {self.call_timeout_s:.0f}s"
                ) from None
            finally:
                await self.registry.release.remote(worker_id, n)
        raise PoolUnavailable(
            f"pool {self.pool!r}: {method} failed on {self.max_retries + 1} workers; last: {last}"
        )
