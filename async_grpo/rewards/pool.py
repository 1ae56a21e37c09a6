"""The verifier: `VerifierWorker` (a plain class, a Ray actor where composed) and
`VerifierPool`, which starts `num_workers` of them and spreads batches over them.

In: lists of `RewardInput`. Out: one combined `RewardOutput` per input, in order, and
counters (`verifier/scored`, `verifier/timeouts`, `verifier/errors`, `verifier/restarts`).
Every sample comes back: a timeout or crash is a 0 with its reason, never an exception.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from async_grpo.config import VerifierConfig
from async_grpo.faults import fault_point
from async_grpo.inference.types import RequestError
from async_grpo.rewards.registry import CombinedReward, RewardInput, RewardOutput, get_reward
from async_grpo.rewards.sandbox import DEFAULT_MEMORY_BYTES, SandboxPool

STATS_KEYS = ("verifier/scored", "verifier/timeouts", "verifier/errors", "verifier/restarts")


class VerifierWorker:
    """Scores samples with the configured rewards, `cfg.max_concurrency` at a time, each
    in a sandbox subprocess killed after `cfg.timeout_s`. Usable with or without Ray."""

    def __init__(self, cfg: VerifierConfig, memory_bytes: int = DEFAULT_MEMORY_BYTES) -> None:
        from async_grpo.logs import to_file

        to_file()  # a quiet run: this actor's output to its own log file
        self._cfg, self._memory_bytes = cfg, memory_bytes
        self._sandbox: SandboxPool | None = None  # none in a run scored by models alone
        if cfg.rewards:  # (its held-out evaluation may still score with eval.rewards)
            scorer = CombinedReward(
                rewards={name: get_reward(name) for name in cfg.rewards},
                rule=cfg.combine,
                weights=dict(cfg.weights),
            )
            self._sandbox = SandboxPool(scorer, cfg.max_concurrency, cfg.timeout_s, memory_bytes)
        self._others: dict[tuple[str, ...], SandboxPool] = {}  # eval.rewards, made on first use
        self._stopping = False
        self.spec = reward_spec(cfg)

    async def score(
        self, items: list[RewardInput], rewards: list[str] | None = None, evaluation: bool = False
    ) -> list[RewardOutput]:
        """One combined output per item, in order: by the configured rewards, or by
        `rewards` summed (an evaluation's own, `eval.rewards`) in sandboxes of their own.
        An `evaluation`'s samples are not counted in the training counters (`stats`)."""
        fault_point("verifier.score")
        return await self._sandbox_for(rewards).score_many(items, counted=not evaluation)

    def _sandbox_for(self, rewards: list[str] | None) -> SandboxPool:
        if rewards is None or list(rewards) == list(self._cfg.rewards):
            if self._sandbox is None:
                raise RequestError("verifier: this run has no rule rewards (verifier.rewards)")
            return self._sandbox
        key = tuple(rewards)
        if key not in self._others:
            scorer = CombinedReward(rewards={name: get_reward(name) for name in key})
            c = self._cfg
            self._others[key] = SandboxPool(
                scorer, c.max_concurrency, c.timeout_s, self._memory_bytes
            )
        return self._others[key]

    def stats(self) -> dict[str, int]:
        """Counters since start (see `SandboxPool.stats`)."""
        if self._sandbox is None:
            return dict.fromkeys(STATS_KEYS, 0)
        return self._sandbox.stats()

    def close(self) -> None:
        """Kill the scoring subprocesses."""
        for sandbox in (self._sandbox, *self._others.values()):
            if sandbox is not None:
                sandbox.close()

    def ping(self) -> dict[str, Any]:
        return {"stopping": self._stopping, "reward_spec": self.spec, **self.stats()}

    async def stop(self, drain_timeout_s: float = 30.0) -> dict[str, int]:
        """The pool-worker stop: no drain is needed beyond the per-sample timeout."""
        self._stopping = True
        self.close()
        return {"abandoned": 0}


def reward_spec(cfg: VerifierConfig) -> str:
    """What a verifier scores with, as one comparable line."""
    weights = ", ".join(f"{k}={v:g}" for k, v in sorted(cfg.weights.items()) if k in cfg.rewards)
    spec = f"{'+'.join(cfg.rewards)} combined by {cfg.combine}"
    return spec + (f" ({weights})" if cfg.combine == "weighted" else "")


def check_verifiers(cfg: VerifierConfig, timeout_s: float = 60.0) -> int:
    """The registered verifier workers score with `cfg`'s rewards, else a `ConfigError`
    naming both (a worker started without the run's config scores with its defaults:
    every sample an error or a wrong reward, silently). Returns the workers checked."""
    return check_specs("verifier", "reward_spec", reward_spec(cfg), "verifier.rewards", timeout_s)


def check_specs(pool: str, key: str, want: str, setting: str, timeout_s: float = 60.0) -> int:
    """Every registered worker of `pool` answers `want` under `key` of its ping, else a
    `ConfigError` on `setting` naming the worker, both specs and the command that fixes
    it. Returns the workers checked."""
    import ray

    from async_grpo.config import ConfigError
    from async_grpo.inference.client import get_registry

    handles = ray.get(get_registry(pool).handles.remote(), timeout=timeout_s)
    pings = ray.get([h.ping.remote() for h in handles.values()], timeout=timeout_s)
    for wid, ping in zip(handles, pings, strict=True):
        if ping.get(key) != want:
            raise ConfigError(
                f"{setting}: worker {wid} works by {ping.get(key)!r}, this run by {want!r};"
                f" start the {pool} workers with this run's config"
                f" (async-grpo worker --mode {pool} --config FILE)"
            )
    return len(pings)


class VerifierPool:
    """`num_workers` VerifierWorker actors; a batch is split into one chunk per worker and
    each chunk goes to the worker with the fewest samples in flight."""

    def __init__(self, actors: list[Any]) -> None:
        if not actors:
            raise ValueError("VerifierPool needs at least one actor")
        self._actors = actors
        self._in_flight = [0] * len(actors)

    @classmethod
    def start(
        cls, cfg: VerifierConfig, num_cpus: float = 1.0, start_timeout_s: float = 120.0
    ) -> VerifierPool:
        """Start the actors (Ray must be initialised) and wait until each one is up.

        `num_cpus` is what each actor reserves from Ray; its subprocesses do the work.
        """
        import ray

        actor_cls = ray.remote(VerifierWorker).options(num_cpus=num_cpus)
        actors = [actor_cls.remote(cfg) for _ in range(cfg.num_workers)]
        try:
            ray.get([a.stats.remote() for a in actors], timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            for actor in actors:
                ray.kill(actor)
            raise TimeoutError(
                f"{cfg.num_workers} verifier workers did not start within {start_timeout_s} s "
                f"(each needs {num_cpus} CPU from Ray)"
            ) from e
        return cls(actors)

    async def score(self, items: list[RewardInput]) -> list[RewardOutput]:
        """Score `items` over the workers; one output per item, in order."""
        if not items:
            return []
        size = math.ceil(len(items) / len(self._actors))
        chunks = [items[i : i + size] for i in range(0, len(items), size)]
        results = await asyncio.gather(*(self._score_chunk(c) for c in chunks))
        return [out for chunk in results for out in chunk]

    async def _score_chunk(self, chunk: list[RewardInput]) -> list[RewardOutput]:
        index = min(range(len(self._actors)), key=self._in_flight.__getitem__)
        self._in_flight[index] += len(chunk)
        try:
            return await self._actors[index].score.remote(chunk)
        finally:
            self._in_flight[index] -= len(chunk)

    def stats(self, timeout_s: float = 30.0) -> dict[str, int]:
        """Counters summed over the workers."""
        import ray

        per_worker = ray.get([a.stats.remote() for a in self._actors], timeout=timeout_s)
        return {key: sum(s.get(key, 0) for s in per_worker) for key in STATS_KEYS}

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the scoring subprocesses, then the actors."""
        import ray

        try:
            ray.get([a.close.remote() for a in self._actors], timeout=timeout_s)
        finally:
            for actor in self._actors:
                ray.kill(actor)
