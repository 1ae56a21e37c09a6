"""EnvironmentWorker: hosts isolated environment instances, one per episode (a plain class;
a Ray actor where composed, registered in the `environment` registry like the verifiers).

`acquire` makes the instances of a whole GRPO group at once, or none: if any constructor
or `reset` fails, the ones already made are closed (a failing close is counted, and never
hides the first error) and nothing was ever visible to another call. Over capacity is a
refusal (`EnvironmentFailed("capacity")`), not a crash. `step` runs under a wall-clock timeout; a step that
raises, hangs or returns garbage is an `EnvironmentFailed` naming why, and the instance
stays held until its episode releases it.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from typing import Any

from async_grpo.config import EnvironmentConfig
from async_grpo.environments.base import Environment, StepResult, Task, checked
from async_grpo.environments.registry import get_environment
from async_grpo.faults import fault_point

STATS_KEYS = ("acquired", "released", "steps", "step_errors", "step_timeouts", "close_failures")


class EnvironmentFailed(Exception):
    """An environment raised, hung past its timeout, or returned garbage; `reason` is the
    counted kind (error, timeout, bad_output; acquire and capacity fail a whole group)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # Ray pickles it to the caller
        return type(self), (self.reason, str(self))


def environment_factory(cfg: EnvironmentConfig) -> Any:
    """A callable making one fresh instance: the named class, or its server-backed client."""
    if cfg.url:
        from async_grpo.environments.http import HttpEnvironment

        return lambda: HttpEnvironment(cfg.url, cfg.step_timeout_s)
    return get_environment(cfg.name)


async def _call(fn: Any, *args: Any) -> Any:
    """Run an environment method: awaited if async, else in a thread (a slow step of one
    episode never blocks the others)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    out = await asyncio.to_thread(fn, *args)
    return await out if inspect.isawaitable(out) else out


class EnvironmentWorker:
    """Up to `cfg.capacity` live instances of `cfg.name` (or of the server at `cfg.url`)."""

    def __init__(self, cfg: EnvironmentConfig, worker_id: str = "env") -> None:
        from async_grpo.logs import to_file

        to_file()
        self.cfg, self.worker_id = cfg, worker_id
        self._make = environment_factory(cfg)
        self._instances: dict[str, Environment] = {}
        self._lock = asyncio.Lock()
        self._counts = dict.fromkeys(STATS_KEYS, 0)
        self._stopping = False

    async def acquire(self, tasks: list[Task]) -> list[str]:
        """One new instance per task, reset: their ids, all or none."""
        async with self._lock:
            if len(self._instances) + len(tasks) > self.cfg.capacity:
                raise EnvironmentFailed(
                    "capacity",
                    f"{self.worker_id}: {len(tasks)} environment instances requested,"
                    f" {self.cfg.capacity - len(self._instances)} of {self.cfg.capacity} free",
                )
            made: list[tuple[str, Environment]] = []
            try:
                for task in tasks:
                    fault_point("environment.acquire")
                    made.append((uuid.uuid4().hex, self._make()))
                    await asyncio.wait_for(
                        _call(made[-1][1].reset, task), timeout=self.cfg.step_timeout_s
                    )
            except BaseException as e:
                for _, env in made:
                    await self._close(env)
                if isinstance(e, Exception):
                    raise EnvironmentFailed(
                        "acquire",
                        f"{self.worker_id}: could not start {len(tasks)} instances"
                        f" of {self.cfg.url or self.cfg.name}: {type(e).__name__}: {e}",
                    ) from None
                raise
            self._instances.update(made)
            self._counts["acquired"] += len(made)
            return [iid for iid, _ in made]

    async def step(self, instance_id: str, action: str) -> StepResult:
        """One step of the episode that holds `instance_id`."""
        env = self._instances.get(instance_id)
        if env is None:
            raise EnvironmentFailed("error", f"{self.worker_id}: no live instance {instance_id}")
        self._counts["steps"] += 1
        t0 = time.monotonic()
        try:
            fault_point("environment.step")
            result = await asyncio.wait_for(
                _call(env.step, action), timeout=self.cfg.step_timeout_s
            )
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
        for env in envs:
            await self._close(env)
        self._counts["released"] += len(envs)
        return len(envs)

    async def _close(self, env: Environment) -> None:
        try:
            await asyncio.wait_for(_call(env.close), timeout=self.cfg.step_timeout_s)
        except Exception as e:  # counted; never hides why the episode ended
            self._counts["close_failures"] += 1
            print(f"{self.worker_id}: closing {type(env).__name__} failed: {e}", flush=True)

    def live(self) -> int:
        """Instances held by episodes now."""
        return len(self._instances)

    def stats(self) -> dict[str, int]:
        return {f"env/{k}": v for k, v in self._counts.items()} | {"env/live": self.live()}

    def ping(self) -> dict[str, Any]:
        return {"stopping": self._stopping, "environment": self.cfg.url or self.cfg.name}

    async def stop(self, drain_timeout_s: float = 30.0) -> dict[str, int]:
        """Close every instance still held (an episode cut short by the stop)."""
        self._stopping = True
        left = await self.release(list(self._instances))
        return {"abandoned": left}
