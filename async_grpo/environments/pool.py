"""EnvironmentWorker: hosts isolated environment instances, one per episode (a plain class;
a Ray actor where composed, registered in the `environment` registry like the verifiers).

`acquire` makes the instances of a whole GRPO group at once (their resets run
concurrently), or none: if any constructor or `reset` fails, the ones already made are
closed (a failing close is counted, and never hides the first error). Over capacity is a
refusal (`EnvironmentFailed("capacity")`), not a crash. A group is named by its caller: a
caller that gives up (a timeout, a cancelled spare group, a stop) drops it, and instances
made after that are released as they arrive; a group held past its hold time is released
by a sweep. `step` runs under a wall-clock timeout; a step that raises, hangs or returns
garbage is an `EnvironmentFailed` naming why, and the instance stays held until its
episode releases it.

Plain `def` methods run on the worker's own bounded thread pool. A call past its timeout
cannot be stopped in its thread; such a stuck thread is counted, and a worker with
`STUCK_LIMIT` of them retires: it refuses new groups and, once no episode holds an
instance, ends its process so that `async-grpo run` starts a fresh one. It says why to its
registry first (which call hung: "reset hung past environment.step_timeout_s (30 s)"), so
the run's supervisor can name it if the pool cannot work at all (async_grpo/cause.py).

Failures that end a whole group say what the environment did, naming it: "environment
'calc' could not be instantiated: ...", "environment 'calc': reset hung past ...".
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from async_grpo import background
from async_grpo.cause import subject
from async_grpo.config import EnvironmentConfig
from async_grpo.deadline import within
from async_grpo.environments.base import Environment, StepResult, Task, checked
from async_grpo.environments.registry import get_environment
from async_grpo.faults import fault_point

STATS_KEYS = (
    "acquired",
    "released",
    "steps",
    "step_errors",
    "step_timeouts",
    "close_failures",
    "stuck_threads",
    "expired",
)
STUCK_LIMIT = 4  # threads still running calls that timed out; then the worker retires
SWEEP_S = 1.0  # how often held groups are checked against their hold time
GIVEN_UP_KEPT_S = 600.0  # how long a give-up waits for its acquire to end


class EnvironmentFailed(Exception):
    """An environment raised, hung past its timeout, or returned garbage; `reason` is the
    counted kind (error, timeout, bad_output; acquire and capacity fail a whole group);
    `worker`: the environment worker's id, where one failed."""

    def __init__(self, reason: str, message: str, worker: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.worker = worker

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:  # Ray pickles it to the caller
        return type(self), (self.reason, str(self), self.worker)


class _NotMade(Exception):
    """The environment's constructor raised (its message: the constructor's error)."""


def environment_factory(cfg: EnvironmentConfig) -> Any:
    """A callable making one fresh instance: the named class, or its server-backed client."""
    if cfg.url:
        from async_grpo.environments.http import HttpEnvironment

        return lambda: HttpEnvironment(cfg.url, cfg.step_timeout_s)
    return get_environment(cfg.name)


class EnvironmentWorker:
    """Up to `cfg.capacity` live instances of `cfg.name` (or of the server at `cfg.url`)."""

    def __init__(self, cfg: EnvironmentConfig, worker_id: str = "env") -> None:
        from async_grpo.logs import to_file

        to_file()
        self.cfg, self.worker_id = cfg, worker_id
        self.subject = subject("environment", [cfg.url or cfg.name])
        self._make = environment_factory(cfg)
        self._instances: dict[str, Environment] = {}
        self._lock = asyncio.Lock()
        self._counts = dict.fromkeys(STATS_KEYS, 0)
        self._stopping = False
        # one thread per instance it may hold, and room for the stuck ones until it retires
        self._threads = ThreadPoolExecutor(cfg.capacity + STUCK_LIMIT, f"{worker_id}-env")
        self._stuck = 0
        self._hung: Counter[str] = Counter()  # calls past the timeout, by method (reset, step)
        self._retired = False  # stuck threads reached STUCK_LIMIT: no new groups
        self._leaving: asyncio.Task | None = None  # _retire, once retired
        self._claimed = 0  # room taken by acquires still making their instances
        self._groups: dict[str, tuple[list[str], float]] = {}  # group -> (ids, held until)
        self._given_up: dict[str, float] = {}  # groups dropped before their acquire ended
        self._sweep: asyncio.Task | None = None

    async def _call(self, fn: Any, *args: Any) -> Any:
        """Run an environment method within the step timeout: awaited if async, else on
        this worker's threads (a slow step of one episode never blocks the others)."""
        if inspect.iscoroutinefunction(fn):
            return await within(fn(*args), self.cfg.step_timeout_s)
        loop = asyncio.get_running_loop()
        job = self._threads.submit(fn, *args)
        try:
            out = await asyncio.wait_for(asyncio.wrap_future(job), self.cfg.step_timeout_s)
        except TimeoutError:
            if not job.done():  # the thread runs on: counted until it returns
                self._stuck += 1
                self._hung[getattr(fn, "__name__", "call")] += 1
                job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._unstick))
                if self._stuck >= STUCK_LIMIT and not self._retired:
                    self._retired = True
                    self._leaving = background.start(self._retire(), f"{self.worker_id}: retiring")
            raise
        if inspect.isawaitable(out):
            return await within(out, self.cfg.step_timeout_s)
        return out

    def _unstick(self) -> None:
        self._stuck -= 1

    def _hung_line(self) -> str:
        """Which calls hung: "reset hung past environment.step_timeout_s (30 s)"."""
        past = f"past environment.step_timeout_s ({self.cfg.step_timeout_s:g} s)"
        if len(self._hung) == 1:
            return f"{next(iter(self._hung))} hung {past}"
        return f"calls hung {past}: " + ", ".join(f"{k} {n}" for k, n in self._hung.most_common())

    async def _retire(self) -> None:
        """Once `_retired` is set: leave the pool's registry saying why, and end once no
        instance is held (stuck threads cannot be freed any other way); the run starts a
        fresh worker."""
        import ray

        from async_grpo.inference.client import get_registry_async

        print(
            f"{self.worker_id}: {self._stuck} threads stuck ({self._hung_line()});"
            " this worker retires",
            flush=True,
        )
        if ray.is_initialized():
            with contextlib.suppress(Exception):  # then refusals send the groups elsewhere
                registry = await get_registry_async("environment", timeout_s=10.0)
                bye = registry.farewell.remote(self.worker_id, self._hung_line())
                await asyncio.wait_for(bye, 10.0)
        self._exit_when_idle()

    def _exit_when_idle(self) -> None:
        if self._retired and not self._instances and not self._claimed:
            asyncio.get_running_loop().call_later(0.5, os._exit, 1)

    async def acquire(self, tasks: list[Task], group: str = "", hold_s: float = 0.0) -> list[str]:
        """One new instance per task, reset concurrently: their ids, all or none. `group`
        names the caller's group for `drop_group`, which releases its instances even when
        it comes before this call ends (a caller that gave up); with `hold_s`, instances
        still held that long after are released by the sweep (a caller that vanished)."""
        self._start_sweep()
        async with self._lock:  # only the room is claimed under the lock
            if self._retired:
                raise EnvironmentFailed(
                    "capacity",
                    f"{self.subject}: worker {self.worker_id} is retiring: {self._hung_line()}",
                    self.worker_id,
                )
            free = self.cfg.capacity - len(self._instances) - self._claimed
            if len(tasks) > free:
                raise EnvironmentFailed(
                    "capacity",
                    f"{self.worker_id}: {len(tasks)} environment instances requested,"
                    f" {free} of {self.cfg.capacity} free",
                    self.worker_id,
                )
            self._claimed += len(tasks)
        try:
            made = await self._make_all(tasks)
        finally:
            self._claimed -= len(tasks)
            if self._leaving is not None:  # it retired: gone from the registry before its
                await asyncio.shield(self._leaving)  # caller tries again (elsewhere)
                self._exit_when_idle()
        ids = [iid for iid, _ in made]
        self._instances.update(made)
        self._counts["acquired"] += len(made)
        if self._given_up.pop(group, None) is not None:
            await self.release(ids)
            raise EnvironmentFailed(
                "acquire", f"{self.worker_id}: group {group} was given up", self.worker_id
            )
        if group:
            self._groups[group] = (ids, time.monotonic() + hold_s if hold_s else float("inf"))
        return ids

    async def _make_all(self, tasks: list[Task]) -> list[tuple[str, Environment]]:
        """The instances, made and reset at once; if any fails, the made ones are closed
        and the group fails with what the environment did (the first failure)."""
        made: list[tuple[str, Environment]] = []

        async def one(task: Task) -> None:
            fault_point("environment.acquire")
            try:
                env = self._make()
            except Exception as e:
                raise _NotMade(f"{type(e).__name__}: {e}") from e
            made.append((uuid.uuid4().hex, env))
            await self._call(env.reset, task)

        try:
            results = await asyncio.gather(*(one(t) for t in tasks), return_exceptions=True)
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:
                raise failed
        except BaseException as e:
            for _, env in made:
                await self._close(env)
            if isinstance(e, Exception):
                raise EnvironmentFailed(
                    "acquire", self._acquire_failed(e), self.worker_id
                ) from None
            raise
        return made

    def _acquire_failed(self, e: Exception) -> str:
        """What the environment did when a group's instances could not be made."""
        if isinstance(e, _NotMade):
            return f"{self.subject} could not be instantiated: {e}"
        if isinstance(e, TimeoutError):
            past = f"past environment.step_timeout_s ({self.cfg.step_timeout_s:g} s)"
            return f"{self.subject}: reset hung {past}"
        return f"{self.subject}: reset raised {type(e).__name__}: {e}"

    async def drop_group(self, group: str) -> int:
        """Release `group`'s instances; one still being made is released when it is."""
        entry = self._groups.pop(group, None)
        if entry is None:
            self._given_up[group] = time.monotonic()
            return 0
        return await self.release(entry[0])

    def _start_sweep(self) -> None:
        if self._sweep is None:
            self._sweep = background.start(self._expire(), f"{self.worker_id}: expiry sweep")

    async def _expire(self) -> None:
        """Release the groups held past their `hold_s`; forget old give-ups."""
        while True:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            for ids, until in list(self._groups.values()):
                if now > until:
                    self._counts["expired"] += await self.release(ids)
            for group, when in list(self._given_up.items()):
                if now - when > GIVEN_UP_KEPT_S:
                    del self._given_up[group]

    async def step(self, instance_id: str, action: str) -> StepResult:
        """One step of the episode that holds `instance_id`."""
        env = self._instances.get(instance_id)
        if env is None:
            raise EnvironmentFailed("error", f"{self.worker_id}: no live instance {instance_id}")
        self._counts["steps"] += 1
        t0 = time.monotonic()
        try:
            fault_point("environment.step")
            result = await self._call(env.step, action)
            return checked(result, f"{type(env).__name__}.step")
        except TimeoutError:
            self._counts["step_timeouts"] += 1
            raise EnvironmentFailed(
                "timeout",
                f"step took over {self.cfg.step_timeout_s:g}s (waited {time.monotonic() - t0:.1f}s)",
            ) from None
        except Exception as e:
            self._counts["step_errors"] += 1
            reason = "bad_output" if type(e).__name__ == "BadStep" else "error"
            raise EnvironmentFailed(reason, f"{type(e).__name__}: {e}") from None

    async def release(self, instance_ids: list[str]) -> int:
        """Close and forget the instances (unknown ids are ignored); returns how many."""
        async with self._lock:
            envs = [self._instances.pop(i) for i in instance_ids if i in self._instances]
            gone = set(instance_ids)
            for group in [g for g, (ids, _) in self._groups.items() if gone.issuperset(ids)]:
                del self._groups[group]
        for env in envs:
            await self._close(env)
        self._counts["released"] += len(envs)
        self._exit_when_idle()
        return len(envs)

    async def _close(self, env: Environment) -> None:
        try:
            await self._call(env.close)
        except Exception as e:  # counted; never hides why the episode ended
            self._counts["close_failures"] += 1
            print(f"{self.worker_id}: closing {type(env).__name__} failed: {e}", flush=True)

    def live(self) -> int:
        """Instances held by episodes now."""
        return len(self._instances)

    def stats(self) -> dict[str, int]:
        counts = self._counts | {"stuck_threads": self._stuck}
        return {f"env/{k}": v for k, v in counts.items()} | {"env/live": self.live()}

    def ping(self) -> dict[str, Any]:
        return {"stopping": self._stopping, "environment": self.cfg.url or self.cfg.name}

    async def stop(self, drain_timeout_s: float = 30.0) -> dict[str, int]:
        """Close every instance still held (an episode cut short by the stop)."""
        self._stopping = True
        if self._sweep is not None:
            self._sweep.cancel()
        left = await self.release(list(self._instances))
        return {"abandoned": left}
