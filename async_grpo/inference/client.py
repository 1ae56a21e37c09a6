"""PoolClient: lease a worker from a pool's registry, call it directly, retry on death.

A dead worker (RayActorError) is dropped from the registry and the request is retried on
another worker, at most `max_retries` times. A `RequestError` (bad input) fails alone and
is not retried. Every wait is bounded and says what it waited for.

A lease is released however the call ends: answered, failed, timed out or cancelled (also
while still waiting for the lease). A call that times out or is cancelled is cancelled in
the worker too (`ray.cancel`: its coroutine gets CancelledError and vLLM aborts the
request), so no ghost work keeps the worker busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from async_grpo.inference.types import PoolUnavailable
from async_grpo.ray_utils import NAMESPACE, registry_name

REGISTRY_TIMEOUT_S = 60.0
LEASE_SLACK_S = 60.0  # a lease outlives its call timeout by this much before it expires


def _lookup_registry(pool: str) -> Any | None:
    import ray

    try:
        return ray.get_actor(registry_name(pool), namespace=NAMESPACE)
    except ValueError:
        return None


def _no_registry(pool: str, timeout_s: float) -> PoolUnavailable:
    return PoolUnavailable(
        f"no registry for pool {pool!r} after {timeout_s:.0f}s:"
        f" start workers with `async-grpo worker --mode {pool}`"
    )


def get_registry(pool: str, timeout_s: float = REGISTRY_TIMEOUT_S) -> Any:
    """The named registry actor of `pool`, waiting for it to appear (for sync callers)."""
    deadline = time.monotonic() + timeout_s
    while (registry := _lookup_registry(pool)) is None:
        if time.monotonic() > deadline:
            raise _no_registry(pool, timeout_s)
        time.sleep(0.5)
    return registry


async def get_registry_async(pool: str, timeout_s: float = REGISTRY_TIMEOUT_S) -> Any:
    """`get_registry` for async code: waits with asyncio.sleep, never blocking the loop."""
    deadline = time.monotonic() + timeout_s
    while (registry := _lookup_registry(pool)) is None:
        if time.monotonic() > deadline:
            raise _no_registry(pool, timeout_s)
        await asyncio.sleep(0.5)
    return registry


class PoolClient:
    """Calls `method` on the least-loaded worker of a pool with room for `n` sequences.

    Construction does not wait: the registry is looked up on the first call (or on the
    first read of `registry` from sync code)."""

    def __init__(
        self,
        pool: str,
        registry: Any = None,
        lease_timeout_s: float = 600.0,
        call_timeout_s: float = 1800.0,
        max_retries: int = 3,
    ) -> None:
        self.pool = pool
        self._registry = registry
        self.lease_timeout_s = lease_timeout_s
        self.call_timeout_s = call_timeout_s
        self.max_retries = max_retries
        self.retries = 0  # requests moved to another worker after a death (a metric)
        self.cancelled = 0  # calls cancelled in the worker after a timeout or cancel (a metric)
        self.release_failures = 0  # releases the registry did not take (a metric)

    @property
    def registry(self) -> Any:
        if self._registry is None:
            self._registry = get_registry(self.pool)
        return self._registry

    async def connect(self) -> None:
        """Find the registry now (async code that wants a missing pool to fail at start,
        not at its first call): PoolUnavailable after REGISTRY_TIMEOUT_S."""
        if self._registry is None:
            self._registry = await get_registry_async(self.pool)

    async def call(
        self,
        n: int,
        method: str,
        *args: Any,
        on_retry: Any = None,
        min_version: int = -1,
        background: bool = False,
        **kwargs: Any,
    ) -> Any:
        """`method(*args, **kwargs)` on a leased worker that serves policy version
        `min_version` or newer; `on_retry()` is called each time the request is sent again
        because its worker died. A `background` call (evaluation) is leased only while no
        other call waits for room in the pool."""
        from async_grpo.ray_utils import gone_errors

        await self.connect()
        last: Exception | None = None
        for _ in range(self.max_retries + 1):
            lease_id = uuid.uuid4().hex
            granted = self._registry.lease.remote(
                n,
                self.lease_timeout_s,
                self.call_timeout_s + LEASE_SLACK_S,
                lease_id,
                min_version,
                background,
            )
            try:
                _, worker_id, handle = await self._ask_registry(
                    granted, f"a lease of {n} sequences", self.lease_timeout_s
                )
                try:
                    return await self._call_worker(handle, worker_id, method, args, kwargs)
                except gone_errors() as e:
                    last = e
                    self.retries += 1
                    if on_retry is not None:
                        on_retry()
                    reason = f"died during {method}: {type(e).__name__}"
                    await self._ask_registry(self._registry.drop.remote(worker_id, reason), "drop")
            finally:
                # submitted at once, so it also happens when this task is cancelled here;
                # a lease released before its grant is never granted
                await self._release(lease_id)
        raise PoolUnavailable(
            f"pool {self.pool!r}: {method} failed on {self.max_retries + 1} workers; last: {last}"
        )

    @contextlib.asynccontextmanager
    async def hold(self, n: int, hold_s: float) -> AsyncIterator[tuple[str, Any]]:
        """Lease room for `n` on one worker for a whole `async with` block (an episode
        group's environment instances): yields (worker id, handle); released however the
        block ends, and expiring by itself after `hold_s` should the release be lost."""
        await self.connect()
        lease_id = uuid.uuid4().hex
        granted = self._registry.lease.remote(n, self.lease_timeout_s, hold_s, lease_id)
        try:
            _, worker_id, handle = await self._ask_registry(
                granted, f"a lease of {n}", self.lease_timeout_s
            )
            yield worker_id, handle
        finally:
            await self._release(lease_id)

    async def drop(self, worker_id: str, reason: str) -> None:
        """Tell the registry a worker was found dead (its leases vanish with it)."""
        await self._ask_registry(self._registry.drop.remote(worker_id, reason), "drop")

    async def _ask_registry(self, ref: Any, what: str, wait_s: float = 0.0) -> Any:
        """Await a registry call: bounded, and a dead registry is named as such."""
        from async_grpo.ray_utils import gone_errors

        limit = wait_s + REGISTRY_TIMEOUT_S
        try:
            return await asyncio.wait_for(ref, timeout=limit)
        except TimeoutError:
            raise PoolUnavailable(
                f"pool {self.pool!r}: its registry did not answer {what} within {limit:.0f}s"
            ) from None
        except gone_errors() as e:
            raise PoolUnavailable(
                f"pool {self.pool!r}: its registry is gone ({type(e).__name__}) during {what}"
            ) from None

    async def _release(self, lease_id: str) -> None:
        """Release, never raising: an unreleased lease expires in the registry anyway."""
        try:
            await self._ask_registry(self._registry.release.remote(lease_id), "a release")
        except PoolUnavailable as e:
            self.release_failures += 1
            print(f"{e} (the lease expires by itself)", flush=True)

    async def _call_worker(
        self, handle: Any, worker_id: str, method: str, args: tuple, kwargs: dict
    ) -> Any:
        import ray

        ref = getattr(handle, method).remote(*args, **kwargs)
        try:
            return await asyncio.wait_for(ref, timeout=self.call_timeout_s)
        except TimeoutError:
            self.cancelled += 1
            ray.cancel(ref)
            raise TimeoutError(
                f"pool {self.pool!r}: worker {worker_id} did not answer {method} within"
                f" {self.call_timeout_s:.0f}s (cancelled there)"
            ) from None
        except asyncio.CancelledError:
            self.cancelled += 1
            ray.cancel(ref)
            raise
