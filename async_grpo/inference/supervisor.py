"""PoolSupervisor: `async-grpo run` restarts the pool workers it started when they die.

Every few seconds each worker is pinged; one Ray reports dead (killed, OOM, an engine that
crashed) is dropped from its registry and a new one of the same pool is started. The new
worker registers, loads the newest checkpoint and joins the next weight push; requests
the dead one held are retried elsewhere by the pool clients. Restarts are counted in the
pool's registry (`pool/<name>/restarts` in the metrics) and capped by `max_worker_restarts`
over the run, so a crash loop ends the run with one line instead of spinning. After each
death the run's files of the dead process in /dev/shm are swept (`sweep`,
async_grpo/shm_files.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

CHECK_EVERY_S = 5.0
PING_TIMEOUT_S = 10.0  # a busy worker may answer late: only a dead one is restarted


class RestartLimit(RuntimeError):
    """More restarts than the config allows."""


class PoolSupervisor:
    def __init__(self, max_restarts: int, sweep: Callable[[], Any] | None = None) -> None:
        """`sweep()` runs after each death is found (the dead process's files)."""
        self.max_restarts = max_restarts
        self.restarts = 0
        self.sweep = sweep
        self.pools: dict[str, tuple[list[Any], Callable[[], list[Any]]]] = {}
        self._last = 0.0

    def watch(self, pool: str, workers: list[Any], start_one: Callable[[], list[Any]]) -> None:
        """Watch `workers` of `pool`; `start_one()` starts (and registers) a replacement."""
        self.pools[pool] = (list(workers), start_one)

    @property
    def workers(self) -> list[Any]:
        return [w for ws, _ in self.pools.values() for w in ws]

    def check(self) -> list[str]:
        """Restart the dead workers (at most every CHECK_EVERY_S); returns one line each."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if time.monotonic() - self._last < CHECK_EVERY_S:
            return []
        self._last = time.monotonic()
        lines = []
        for pool, (workers, start_one) in self.pools.items():
            for i, w in enumerate(list(workers)):
                try:
                    ray.get(w.ping.remote(), timeout=PING_TIMEOUT_S)
                    continue
                except GetTimeoutError:
                    continue
                except RayActorError:
                    pass
                self.restarts += 1
                if self.sweep is not None:
                    self.sweep()
                if self.restarts > self.max_restarts:
                    raise RestartLimit(
                        f"pool {pool!r}: a worker died; worker deaths in this run: {self.restarts}"
                        f" (max_worker_restarts={self.max_restarts}); stopping the run"
                    )
                registry = _registry(pool)
                ray.get(registry.deregister_handles.remote([w]), timeout=60)
                ray.get(registry.count_restart.remote(), timeout=60)  # before it can serve
                (new,) = start_one()
                workers[i] = new
                lines.append(
                    f"pool {pool!r}: a worker died; started a new one"
                    f" ({self.restarts}/{self.max_restarts} restarts)"
                )
        return lines


def _registry(pool: str) -> Any:
    from async_grpo.inference.client import get_registry

    return get_registry(pool)
