"""PoolSupervisor: `async-grpo run` restarts the pool workers it started when they die.

Every few seconds each worker is pinged; one Ray reports dead (killed, OOM, an engine that
crashed) is dropped from its registry and a new one of the same pool is started. The new
worker registers, loads the newest checkpoint and joins the next weight push; requests
the dead one held are retried elsewhere by the pool clients. Restarts are counted in the
pool's registry (`pool/<name>/restarts` in the metrics) and capped by `max_worker_restarts`
over the run, so a crash loop ends the run with one line instead of spinning.

That line is the run's cause (async_grpo/cause.py): it names the pool, what the pool runs
and what its workers did, in their own words where a worker said why it ended (an
environment worker whose calls hung retires and says which), with how many in a row ended
the same way. After each death the run's files of the dead process in /dev/shm are swept
(`sweep`, async_grpo/shm_files.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

CHECK_EVERY_S = 5.0
PING_TIMEOUT_S = 10.0  # a busy worker may answer late: only a dead one is restarted


class RestartLimit(RuntimeError):
    """More restarts than the config allows; the message is the run's cause line."""


class PoolSupervisor:
    def __init__(self, max_restarts: int, sweep: Callable[[], Any] | None = None) -> None:
        """`sweep()` runs after each death is found (the dead process's files)."""
        self.max_restarts = max_restarts
        self.restarts = 0
        self.sweep = sweep
        self.pools: dict[str, tuple[list[Any], Callable[[], list[Any]]]] = {}
        self.subjects: dict[str, str] = {}  # pool -> what it runs (cause.subject)
        self.streaks: dict[str, tuple[str | None, int]] = {}  # pool -> (last words, in a row)
        self._last = 0.0

    def watch(
        self,
        pool: str,
        workers: list[Any],
        start_one: Callable[[], list[Any]],
        subject: str | None = None,
    ) -> None:
        """Watch `workers` of `pool`; `start_one()` starts (and registers) a replacement;
        `subject`: what the pool runs (`environment 'calc'`), for the cause line."""
        self.pools[pool] = (list(workers), start_one)
        if subject:
            self.subjects[pool] = subject

    @property
    def workers(self) -> list[Any]:
        return [w for ws, _ in self.pools.values() for w in ws]

    def check(self) -> list[str]:
        """Restart the dead workers (at most every CHECK_EVERY_S); returns one line each."""
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        if time.monotonic() - self._last < CHECK_EVERY_S:
            return []
        self._last = time.monotonic()
        lines = []
        for pool, (workers, start_one) in self.pools.items():
            for i, w in enumerate(list(workers)):
                try:
                    ray.get(w.ping.remote(), timeout=PING_TIMEOUT_S)
                    continue
                except (GetTimeoutError, ActorUnavailableError):
                    continue  # busy, or its node unreachable: Ray says which in a while
                except RayActorError:
                    pass
                self.restarts += 1
                registry = _registry(pool)
                words = ray.get(registry.farewell_of.remote(w), timeout=60)
                self._count(pool, words)
                if self.sweep is not None:
                    self.sweep()
                if self.restarts > self.max_restarts:
                    raise RestartLimit(
                        f"{self.cause(pool)}; worker deaths in this run: {self.restarts}"
                        f" (max_worker_restarts={self.max_restarts}); stopping the run"
                    )
                ray.get(registry.deregister_handles.remote([w]), timeout=60)
                ray.get(registry.count_restart.remote(), timeout=60)  # before it can serve
                (new,) = start_one()
                workers[i] = new
                why = f"; it said: {words}" if words else ""
                lines.append(
                    f"pool {pool!r}: a worker died; started a new one"
                    f" ({self.restarts}/{self.max_restarts} restarts{why})"
                )
        return lines

    def _count(self, pool: str, words: str | None) -> None:
        """One more death in `pool`: the streak of deaths that ended the same way."""
        last, n = self.streaks.get(pool, (None, 0))
        self.streaks[pool] = (words, n + 1 if n and words == last else 1)

    def cause(self, pool: str) -> str:
        """The pool's deaths so far, as the run's cause: `pool 'environment' (environment
        'calc'): reset hung past environment.step_timeout_s (30 s) on 4 workers in a row`."""
        words, n = self.streaks.get(pool, (None, 0))
        subject = self.subjects.get(pool)
        where = f"pool {pool!r} ({subject})" if subject else f"pool {pool!r}"
        if words is None:
            what = "a worker died" if n <= 1 else f"{n} workers in a row died"
        else:
            what = words if n <= 1 else f"{words} on {n} workers in a row"
        return f"{where}: {what}"


def _registry(pool: str) -> Any:
    from async_grpo.inference.client import get_registry

    return get_registry(pool)


def pool_subject(cfg: Any, pool: str, model: str | None = None) -> str:
    """What `pool` runs under the run config `cfg` (and `model`, where it is not cfg's),
    for its cause line (cause.subject)."""
    from async_grpo.cause import subject

    if pool == "environment":
        return subject("environment", [cfg.environment.url or cfg.environment.name])
    if pool == "verifier":
        return subject("reward function", cfg.verifier.rewards)
    if pool in ("judge", "reward_model"):
        kind = "judge model" if pool == "judge" else "reward model"
        return subject(kind, [getattr(cfg.verifier, pool).model])
    return subject("model", [model or cfg.model])
