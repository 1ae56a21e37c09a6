"""LeastLoadedRegistry: which workers of a pool are alive, how busy, and on which weights.

Workers register with a capacity (concurrent sequences) and heartbeat. Callers lease the
least-loaded worker with room for `n` sequences, talk to it directly (the registry never
carries tensors), then release the lease. Runs as one named Ray actor per pool; the class
is plain so tests can drive it without Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from async_grpo.inference.types import PoolUnavailable, WorkerStatus


@dataclass
class _Worker:
    handle: Any
    capacity: int
    load: int
    version: int
    node: str
    last_heartbeat: float
    heartbeats: bool = True


class LeastLoadedRegistry:
    """Leases, liveness and the latest published weights of one pool."""

    def __init__(self, pool: str, heartbeat_timeout_s: float = 30.0) -> None:
        self.pool = pool
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._workers: dict[str, _Worker] = {}
        self._changed = asyncio.Condition()
        self._weights: tuple[int, list[Any]] | None = None  # (version, [ObjectRef])
        self.dropped: dict[str, str] = {}  # worker id -> reason

    async def register(
        self,
        worker_id: str,
        handle: Any,
        capacity: int,
        version: int,
        node: str = "",
        heartbeats: bool = True,
    ) -> tuple[int, list[Any]] | None:
        """Add a worker; returns the latest published weights it should load first, if any.

        A worker registered with `heartbeats=False` never expires; callers still drop it
        when a call finds it dead."""
        if capacity <= 0:
            raise ValueError(f"worker {worker_id}: capacity must be > 0, got {capacity}")
        self._workers[worker_id] = _Worker(
            handle, capacity, 0, version, node, time.monotonic(), heartbeats
        )
        self.dropped.pop(worker_id, None)
        await self._notify()
        if self._weights is not None and self._weights[0] > version:
            return self._weights
        return None

    async def heartbeat(self, worker_id: str, version: int) -> bool:
        """False tells the worker it was dropped and must register again."""
        w = self._workers.get(worker_id)
        if w is None:
            return False
        w.last_heartbeat, w.version = time.monotonic(), version
        return True

    async def deregister(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        await self._notify()

    async def drop(self, worker_id: str, reason: str) -> None:
        """Remove a worker a caller found dead; its leases vanish with it."""
        if self._workers.pop(worker_id, None) is not None:
            self.dropped[worker_id] = reason
            await self._notify()

    async def lease(self, n: int, timeout_s: float) -> tuple[str, Any]:
        """The least-loaded live worker with room for `n` sequences; waits up to `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        async with self._changed:
            while True:
                self._expire()
                if self._workers and n > max(w.capacity for w in self._workers.values()):
                    raise PoolUnavailable(
                        f"pool {self.pool!r}: a request for {n} sequences can never fit"
                        f" (largest worker capacity is"
                        f" {max(w.capacity for w in self._workers.values())})"
                    )
                room = [
                    (w.load / w.capacity, wid)
                    for wid, w in self._workers.items()
                    if w.capacity - w.load >= n
                ]
                if room:
                    _, wid = min(room)
                    self._workers[wid].load += n
                    return wid, self._workers[wid].handle
                left = deadline - time.monotonic()
                if left <= 0:
                    what = "no live workers" if not self._workers else "all workers busy"
                    raise PoolUnavailable(
                        f"pool {self.pool!r}: waited {timeout_s:.0f}s to lease {n} sequences"
                        f" ({what}; dropped: {self.dropped or 'none'})"
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=min(left, 1.0))

    async def release(self, worker_id: str, n: int) -> None:
        w = self._workers.get(worker_id)
        if w is not None:
            w.load = max(0, w.load - n)
            await self._notify()

    async def publish_weights(self, version: int, ref: list[Any]) -> None:
        """Keep the latest weights (a one-element list holding an ObjectRef) for late joiners."""
        self._weights = (version, ref)

    async def status(self) -> list[WorkerStatus]:
        now = time.monotonic()
        return [
            WorkerStatus(
                wid,
                self.pool,
                w.capacity,
                w.load,
                w.version,
                w.node,
                round(now - w.last_heartbeat, 1),
            )
            for wid, w in sorted(self._workers.items())
        ]

    async def handles(self) -> dict[str, Any]:
        return {wid: w.handle for wid, w in self._workers.items()}

    def _expire(self) -> None:
        now = time.monotonic()
        for wid, w in list(self._workers.items()):
            if w.heartbeats and now - w.last_heartbeat > self.heartbeat_timeout_s:
                del self._workers[wid]
                self.dropped[wid] = f"no heartbeat for {now - w.last_heartbeat:.0f}s"

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
