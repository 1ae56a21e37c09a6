"""What every pool worker shares: registration, heartbeats, load, version, drain."""

from __future__ import annotations

import asyncio
import collections
import os
import time
from typing import Any

from async_grpo import background
from async_grpo.ray_utils import node_label

HEARTBEAT_S = 2.0
REGISTRY_CALL_TIMEOUT_S = 60.0  # register / heartbeat answered by the pool's registry


class BusyClock:
    """Seconds during which a worker had at least one request to work on and was not paused
    (for a weight update), and seconds since it started: their ratio over a window is the
    worker's busy fraction. The busy stretches themselves are kept too (wall clock, with the
    version served; the last MAX_SPANS) for the run's timeline."""

    MAX_SPANS = 4096

    def __init__(self) -> None:
        self.started = self._last = time.monotonic()
        self.busy_s = 0.0
        self.version = 0  # the version served, set by the worker
        self._open = 0  # requests in the engine
        self._paused = False
        self._since: float | None = None  # wall start of the busy stretch under way
        self.spans: collections.deque = collections.deque(maxlen=self.MAX_SPANS)

    def _counting(self) -> bool:
        return bool(self._open) and not self._paused

    def _change(self, open_delta: int = 0, paused: bool | None = None) -> None:
        now = time.monotonic()
        was = self._counting()
        if was:
            self.busy_s += now - self._last
        self._last = now
        self._open += open_delta
        if paused is not None:
            self._paused = paused
        if self._counting() and not was:
            self._since = time.time()
        elif was and not self._counting():
            self.spans.append((self._since, time.time(), self.version))
            self._since = None

    def enter(self) -> None:
        self._change(open_delta=1)

    def leave(self) -> None:
        self._change(open_delta=-1)

    def pause(self, paused: bool) -> None:
        self._change(paused=paused)

    def read(self) -> tuple[float, float]:
        """(busy seconds, seconds up) so far."""
        self._change()
        return self.busy_s, self._last - self.started

    def spans_since(self, since: float) -> tuple[list[tuple[float, float, int]], float]:
        """The busy stretches after wall time `since` (cut at it; the one under way up to
        now), and now: the `since` of the next call, so no stretch is counted twice."""
        now = time.time()
        spans = [(max(a, since), b, v) for a, b, v in self.spans if b > since]
        if self._since is not None:
            spans.append((max(self._since, since), now, self.version))
        return spans, now


class RegisteredWorker:
    """Base of the generation and logprob workers (plain classes; Ray wraps them)."""

    pool = "base"

    def __init__(self, worker_id: str, capacity: int) -> None:
        from async_grpo.logs import to_file

        to_file()  # a quiet run: this actor's output (and its engine's) to its own log file
        self.worker_id = worker_id
        self.capacity = capacity
        self.version = 0
        self.in_flight = 0
        self.stopping = False
        self.dtype = "float32"  # what the model computes in, once started
        self.registry: Any = None
        self.weight_load_failures = 0  # checkpoints that could not be loaded (a metric)
        self.transport = ""  # how pushed weights reach this worker, once a trainer set it up
        self.clock = BusyClock()
        self._heartbeat: asyncio.Task | None = None

    async def register(self) -> None:
        """Join the pool's registry (inside a Ray actor); load a newer checkpoint first."""
        import ray

        from async_grpo.inference.client import get_registry_async

        self.registry = await get_registry_async(self.pool)
        me = ray.get_runtime_context().current_actor
        await self._join(me)
        self._heartbeat = self._background(self._beat(me), "heartbeat")

    def _background(self, coro: Any, what: str) -> asyncio.Task:
        """A loop this worker cannot serve without: its error ends the worker, named."""
        return background.start(coro, f"{self.worker_id}: {what}", end=self._exit)

    def _exit(self, why: str) -> None:
        """End this actor's process at once (its pool starts a replacement)."""
        print(f"{self.worker_id}: {why}; this worker ends", flush=True)
        os._exit(1)

    async def _join(self, me: Any) -> None:
        """Register (again) and load the checkpoint the registry says is newer than ours."""
        latest = await self._ask_registry(
            self.registry.register.remote(
                self.worker_id, me, self.capacity, self.version, node_label()
            ),
            "register",
        )
        if latest is not None and await self.load_checkpoint(*latest):
            await self._ask_registry(self._heartbeat_ref(), "heartbeat")

    async def _ask_registry(self, ref: Any, what: str) -> Any:
        try:
            return await asyncio.wait_for(ref, timeout=REGISTRY_CALL_TIMEOUT_S)
        except TimeoutError:
            raise TimeoutError(
                f"{self.worker_id}: the {self.pool} registry did not answer {what}"
                f" within {REGISTRY_CALL_TIMEOUT_S:.0f}s"
            ) from None

    async def load_checkpoint(self, version: int, hf_dir: str) -> bool:
        """Serve the weights saved as `version` in `hf_dir`. If they cannot be loaded (the
        folder is not on this node), say so in one line and keep serving the current
        weights: the trainer's next push brings this worker up to date."""
        readable = ("config.json", "adapter_config.json")  # a model, or a LoRA adapter
        if not any(os.path.exists(os.path.join(hf_dir, f)) for f in readable):
            self.weight_load_failures += 1
            print(
                f"{self.worker_id}: checkpoint version {version} ({hf_dir}) is not readable"
                f" here; serving version {self.version} until the next push",
                flush=True,
            )
            return False
        if version > self.version:  # a push may have overtaken this load
            await self.load_weights_dir(hf_dir, version)
        return True

    async def load_weights_dir(self, hf_dir: str, version: int) -> int:
        raise NotImplementedError

    def _heartbeat_ref(self) -> Any:
        return self.registry.heartbeat.remote(
            self.worker_id, self.version, self.in_flight, self.transport
        )

    async def report_version(self) -> None:
        """Tell the registry the version now served at once (not at the next heartbeat):
        leases that need it wait on this. A failure only delays it to the next beat."""
        if self.registry is None:
            return
        try:
            await self._ask_registry(self._heartbeat_ref(), "heartbeat")
        except Exception as e:
            print(f"{self.worker_id}: version {self.version} not reported yet: {e}", flush=True)

    async def _beat(self, me: Any) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                known = await self._ask_registry(self._heartbeat_ref(), "heartbeat")
                if not known:  # dropped (e.g. a slow heartbeat): join again
                    await self._join(me)
            except Exception as e:  # the registry may be restarting; keep serving
                print(f"{self.worker_id}: heartbeat failed: {e}", flush=True)

    async def clock_reading(self, since: float) -> dict[str, Any]:
        """Busy and up seconds so far, and the busy stretches after wall time `since`."""
        busy_s, up_s = self.clock.read()
        spans, now = self.clock.spans_since(since)
        return {
            "worker_id": self.worker_id,
            "busy_s": busy_s,
            "up_s": up_s,
            "spans": spans,
            "now": now,
        }

    def bind_cores(self, cpus: str | None, where: str) -> None:
        """Bind this worker's process to the cores of `cpus` (async_grpo/placement.py), before
        its engine or model starts threads; None leaves it on any core."""
        from async_grpo.placement import bind_process, compact, parse_cpus, process_cpus

        if cpus is not None:
            bind_process(parse_cpus(cpus, where), where)
            print(f"{self.worker_id}: bound to cores {compact(process_cpus())}", flush=True)

    async def ping(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "version": self.version,
            "in_flight": self.in_flight,
            "requests_served": getattr(self, "requests_served", 0),
            "dtype": self.dtype,
            "stopping": self.stopping,
            "weight_load_failures": self.weight_load_failures,
            "transport": self.transport,
        }

    async def drain(self, timeout_s: float) -> dict[str, int]:
        """Deregister (no new leases), then wait for in-flight requests up to `timeout_s`."""
        self.stopping = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self.registry is not None:
            await self.registry.deregister.remote(self.worker_id)
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return {"abandoned": self.in_flight}
