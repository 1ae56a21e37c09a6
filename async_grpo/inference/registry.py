"""LeastLoadedRegistry: which workers of a pool are alive, how busy, and on which weights.

Workers register with a capacity (concurrent sequences) and heartbeat. Callers lease the
least-loaded worker with room for `n` sequences, talk to it directly (the registry never
carries requests), then release the lease by its id. Runs as one named, detached Ray actor
per pool, so it outlives runs; the class is plain so tests can drive it without Ray.

Leases cannot leak across runs: each one expires (the caller's call timeout plus slack),
and a worker's heartbeat reports its own in-flight count, which reclaims leases that no
running request backs (a caller that crashed or was cancelled). The registry also knows
the trainer's newest saved checkpoint (a folder path, never the weights themselves), which a
worker that joins mid-run loads before its first push.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

from async_grpo import background
from async_grpo.inference.types import PoolUnavailable, WorkerStatus

DEFAULT_HOLD_S = 3600.0  # a lease's life when the caller names none
FAREWELLS_KEPT = 64  # the newest workers' last words (a supervisor asks within seconds)


@dataclass
class _Worker:
    handle: Any
    capacity: int
    version: int
    node: str
    last_heartbeat: float
    heartbeats: bool = True
    load: int = 0  # sequences leased (sum of its live leases)
    transport: str = ""  # how pushed weights reach it, as its heartbeat reports


@dataclass
class _Lease:
    worker_id: str
    n: int
    granted: float
    expires: float


class LeastLoadedRegistry:
    """Leases, liveness and the newest checkpoint of one pool."""

    def __init__(
        self, pool: str, heartbeat_timeout_s: float = 30.0, lease_grace_s: float = 10.0
    ) -> None:
        self.pool = pool
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # a lease older than this must show in its worker's reported in-flight count
        self.lease_grace_s = lease_grace_s
        self._workers: dict[str, _Worker] = {}
        self._leases: dict[str, _Lease] = {}
        self._released_early: dict[str, float] = {}  # lease id -> when (released before grant)
        self._changed = asyncio.Condition()
        self._checkpoint: tuple[int, str] | None = None  # (version, HF folder)
        self._prober: asyncio.Task | None = None
        self.dropped: dict[str, str] = {}  # worker id -> reason
        # workers that ended themselves, and why (their own words, for the supervisor)
        self._farewells: list[tuple[Any, str]] = []  # (handle, line), the newest last
        self.reclaimed = {"expired": 0, "unbacked": 0}  # leases taken back (a metric)
        self.restarts = 0  # dead workers a launcher replaced (a metric)
        self._foreground_waiting = 0  # training leases waiting for room (background yields)

    async def register(
        self,
        worker_id: str,
        handle: Any,
        capacity: int,
        version: int,
        node: str = "",
        heartbeats: bool = True,
    ) -> tuple[int, str] | None:
        """Add a worker; returns the newest checkpoint (version, HF folder) if it is newer
        than the worker's weights: the worker loads it before serving.

        The same worker (same handle) may register again, e.g. after being dropped for a
        slow heartbeat; its leases stay. Another actor under a registered id is refused.
        A worker registered with `heartbeats=False` never expires; callers still drop it
        when a call finds it dead."""
        if capacity <= 0:
            raise ValueError(f"worker {worker_id}: capacity must be > 0, got {capacity}")
        old = self._workers.get(worker_id)
        if old is not None and old.handle != handle:
            raise ValueError(
                f"pool {self.pool!r}: worker id {worker_id!r} is already registered by another"
                f" actor (node {old.node or '?'}); worker ids must be unique"
            )
        load = old.load if old is not None else 0
        self._workers[worker_id] = _Worker(
            handle, capacity, version, node, time.monotonic(), heartbeats, load
        )
        self.dropped.pop(worker_id, None)
        if not heartbeats and self._prober is None:
            self._prober = background.start(  # failed: said, and started again at a join
                self._probe_silent(), f"registry:{self.pool} prober", end=self._unprobed
            )
        await self._notify()
        if self._checkpoint is not None and self._checkpoint[0] > version:
            return self._checkpoint
        return None

    async def heartbeat(
        self, worker_id: str, version: int, in_flight: int | None = None, transport: str = ""
    ) -> bool:
        """False tells the worker it was dropped and must register again.

        `in_flight`: sequences the worker is serving now; leases older than the grace
        period beyond that count are reclaimed, oldest first."""
        w = self._workers.get(worker_id)
        if w is None:
            return False
        now = time.monotonic()
        w.last_heartbeat, w.version = now, version
        w.transport = transport or w.transport
        if in_flight is not None:
            old = sorted(
                (le.granted, lid)
                for lid, le in self._leases.items()
                if le.worker_id == worker_id and now - le.granted > self.lease_grace_s
            )
            excess = sum(self._leases[lid].n for _, lid in old) - in_flight
            for _, lid in old:
                if excess <= 0:
                    break
                excess -= self._leases[lid].n
                self._end_lease(lid, "unbacked")
            await self._notify()
        return True

    async def deregister(self, worker_id: str) -> None:
        self._forget(worker_id)
        await self._notify()

    async def deregister_handles(self, handles: list[Any]) -> list[str]:
        """Deregister the workers behind these actor handles (a launcher stopping what it
        started: verifier workers do not deregister themselves); returns their ids."""
        gone = [wid for wid, w in self._workers.items() if any(w.handle == h for h in handles)]
        for wid in gone:
            self._forget(wid)
        await self._notify()
        return gone

    async def count_restart(self) -> int:
        self.restarts += 1
        return self.restarts

    async def restart_count(self) -> int:
        return self.restarts

    async def drop(self, worker_id: str, reason: str) -> None:
        """Remove a worker a caller found dead; its leases vanish with it."""
        node = self._node(worker_id)
        if self._forget(worker_id):
            self.dropped[worker_id] = reason + node
            await self._notify()

    async def lost(self) -> dict[str, str]:
        """The workers dropped and not back: id -> why, and on which node."""
        return dict(self.dropped)

    def _node(self, worker_id: str) -> str:
        w = self._workers.get(worker_id)
        return f" (node {w.node})" if w is not None and w.node else ""

    async def farewell(self, worker_id: str, line: str) -> None:
        """A worker about to end its own process says why (`line`: what it ran did, e.g.
        "reset hung past environment.step_timeout_s (30 s)"), and leaves the pool."""
        w = self._workers.get(worker_id)
        if w is not None:
            self._farewells = [*self._farewells[-(FAREWELLS_KEPT - 1) :], (w.handle, line)]
        await self.drop(worker_id, line)

    async def farewell_of(self, handle: Any) -> str | None:
        """Why the worker behind `handle` ended itself; None if it did not say."""
        return next((line for h, line in reversed(self._farewells) if h == handle), None)

    async def lease(
        self,
        n: int,
        timeout_s: float,
        hold_s: float = DEFAULT_HOLD_S,
        lease_id: str | None = None,
        min_version: int = -1,
        background: bool = False,
    ) -> tuple[str, str, Any]:
        """The least-loaded live worker with room for `n` sequences that serves policy
        version `min_version` or newer, as (lease id, worker id, handle); waits up to
        `timeout_s`. A worker behind it (a replacement, a late joiner) is not leased until
        a push brings it up. The lease expires after `hold_s` unless released first. A
        caller may choose `lease_id` so it can release a lease whose grant it never saw
        (it was cancelled while waiting). A `background` lease (evaluation) is granted only
        while no other lease waits for room on a worker that serves its version: training
        requests always go first, and one that waits for a push holds nothing back."""
        lease_id = lease_id or uuid.uuid4().hex
        deadline = time.monotonic() + timeout_s
        counted = False  # this foreground lease is in _foreground_waiting
        try:
            async with self._changed:
                while True:
                    if self._released_early.pop(lease_id, None) is not None:
                        raise PoolUnavailable(f"pool {self.pool!r}: lease {lease_id} was cancelled")
                    self._expire()
                    self._check_fits(n)
                    room = [
                        (w.load / w.capacity, wid)
                        for wid, w in self._workers.items()
                        if w.capacity - w.load >= n and w.version >= min_version
                    ]
                    if room and not (background and self._foreground_waiting):
                        _, wid = min(room)
                        now = time.monotonic()
                        self._leases[lease_id] = _Lease(wid, n, now, now + hold_s)
                        self._workers[wid].load += n
                        return lease_id, wid, self._workers[wid].handle
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self._lease_timeout(n, timeout_s, min_version, background)
                    # waiting for room counts; waiting for a push (no worker serves
                    # min_version yet) does not: that push may wait for an evaluation
                    for_room = any(w.version >= min_version for w in self._workers.values())
                    if not background and for_room != counted:
                        counted = for_room
                        self._foreground_waiting += 1 if for_room else -1
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), timeout=min(left, 1.0))
        finally:
            if counted:
                self._foreground_waiting -= 1
                await self._notify()  # a background lease may go now

    def _check_fits(self, n: int) -> None:
        """PoolUnavailable for a request larger than every worker's capacity."""
        if self._workers and n > max(w.capacity for w in self._workers.values()):
            raise PoolUnavailable(
                f"pool {self.pool!r}: a request for {n} sequences can never fit"
                f" (largest worker capacity is"
                f" {max(w.capacity for w in self._workers.values())})"
            )

    def _lease_timeout(
        self, n: int, timeout_s: float, min_version: int, background: bool
    ) -> PoolUnavailable:
        behind = sum(w.version < min_version for w in self._workers.values())
        what = "no live workers" if not self._workers else "all workers busy"
        if behind:
            what = f"{behind} worker(s) behind version {min_version}"
        if background and self._foreground_waiting:
            what += "; a background lease waits while training leases wait"
        return PoolUnavailable(
            f"pool {self.pool!r}: waited {timeout_s:.0f}s to lease {n} sequences"
            f" ({what}; dropped: {self.dropped or 'none'})"
        )

    async def release(self, lease_id: str) -> None:
        """End a lease. Idempotent; a lease released before it was granted is never granted."""
        if lease_id in self._leases:
            self._end_lease(lease_id, None)
        else:  # not granted (yet), or already ended
            now = time.monotonic()
            self._released_early[lease_id] = now
            for lid, t in list(self._released_early.items()):  # bounded: forget old ids
                if now - t > DEFAULT_HOLD_S:
                    del self._released_early[lid]
        await self._notify()

    async def announce_checkpoint(self, version: int, hf_dir: str | None) -> None:
        """The trainer saved `version` as a Hugging Face folder: late joiners load it.
        `hf_dir=None` (a run starting) forgets the last run's: its versions count anew."""
        if hf_dir is None:
            self._checkpoint = None
        elif self._checkpoint is None or version >= self._checkpoint[0]:
            self._checkpoint = (version, hf_dir)

    async def status(self) -> list[WorkerStatus]:
        self._expire()
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
                w.transport,
            )
            for wid, w in sorted(self._workers.items())
        ]

    async def handles(self) -> dict[str, Any]:
        return {wid: w.handle for wid, w in self._workers.items()}

    def _unprobed(self, _: str) -> None:
        self._prober = None

    async def _probe_silent(self) -> None:
        """Workers without heartbeats (verifiers) are pinged every heartbeat_timeout_s / 3;
        a dead one is dropped, so a run that crashed leaves no dead entry behind. Plain
        handles (tests without Ray) are not probed."""
        from ray.exceptions import ActorUnavailableError, RayActorError

        while True:
            await asyncio.sleep(self.heartbeat_timeout_s / 3)
            for wid, w in list(self._workers.items()):
                ready = getattr(w.handle, "__ray_ready__", None)
                if w.heartbeats or ready is None:
                    continue
                try:
                    await asyncio.wait_for(ready.remote(), timeout=self.heartbeat_timeout_s)
                except RayActorError as e:
                    await self.drop(wid, f"actor died ({type(e).__name__})")
                except (TimeoutError, ActorUnavailableError):  # busy, or its node unreachable
                    pass  # probed again next round; Ray declares a lost node's actors dead

    def _end_lease(self, lease_id: str, reclaimed: str | None) -> None:
        le = self._leases.pop(lease_id)
        w = self._workers.get(le.worker_id)
        if w is not None:
            w.load = max(0, w.load - le.n)
        if reclaimed:
            self.reclaimed[reclaimed] += 1

    def _forget(self, worker_id: str) -> bool:
        for lid in [lid for lid, le in self._leases.items() if le.worker_id == worker_id]:
            del self._leases[lid]
        return self._workers.pop(worker_id, None) is not None

    def _expire(self) -> None:
        now = time.monotonic()
        for lid in [lid for lid, le in self._leases.items() if le.expires < now]:
            self._end_lease(lid, "expired")
        for wid, w in list(self._workers.items()):
            if w.heartbeats and now - w.last_heartbeat > self.heartbeat_timeout_s:
                node = self._node(wid)
                self._forget(wid)
                self.dropped[wid] = f"no heartbeat for {now - w.last_heartbeat:.0f}s{node}"

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
