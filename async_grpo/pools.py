"""Compose the pools on a Ray cluster: registries and workers, options from config.

This is the one place where plain worker classes become Ray actors, so tests can build
the classes without Ray and resources are never hard-coded in class decorators.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from async_grpo.config import (
    EnvironmentConfig,
    GenerationConfig,
    JudgeConfig,
    LogprobConfig,
    RewardModelConfig,
    RunConfig,
    VerifierConfig,
)
from async_grpo.errors import UserError
from async_grpo.inference.types import AdapterServing
from async_grpo.ray_utils import NAMESPACE, actor_node, registry_name

START_TIMEOUT_S = 900.0
VERIFIER_CAPACITY = 4096  # samples a verifier worker accepts at once
POOLS = ("generation", "logprob", "verifier", "environment", "judge", "reward_model")


def worker_ids(prefix: str, count: int) -> list[str]:
    """Ids unique across commands, nodes and runs: `async-grpo worker` started on two nodes
    in the same second must not collide (the registry refuses a second actor under an id)."""
    batch = uuid.uuid4().hex[:8]
    return [f"{prefix}-{batch}-{i}" for i in range(count)]


def ensure_registry(
    pool: str, heartbeat_timeout_s: float = 30.0, lease_grace_s: float = 10.0
) -> Any:
    """The pool's named registry actor, created if absent (detached: it outlives drivers;
    on the head node: it outlives any other node). An existing registry keeps the settings
    it was created with."""
    import ray

    from async_grpo.inference.registry import LeastLoadedRegistry
    from async_grpo.ray_utils import on_head_node

    return (
        ray.remote(LeastLoadedRegistry)
        .options(
            name=registry_name(pool),
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            max_concurrency=1000,
            **on_head_node(),
        )
        .remote(pool, heartbeat_timeout_s, lease_grace_s)
    )


def _wait_started(refs: list[Any], what: str, timeout_s: float) -> list[str]:
    import ray

    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        raise TimeoutError(
            f"{len(pending)} of {len(refs)} {what} did not start within {timeout_s:.0f}s"
        )
    return ray.get(ready)


@dataclass
class Starting:
    """A pool's actors, created, with their start calls in flight: `wait()` returns them
    once every one has started (and is registered), or raises naming the pool. Pools
    begun one after another start side by side (`async-grpo run` starts the trainer too)."""

    pool: str
    workers: list[Any]
    refs: list[Any]
    timeout_s: float
    then: Callable[[], None] | None = None  # registers workers that do not register themselves

    def done(self, timeout_s: float) -> bool:
        """Whether every start call has returned (or failed), waiting at most `timeout_s`."""
        import ray

        return not ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)[1]

    def wait(self, timeout_s: float | None = None) -> list[Any]:
        _wait_started(self.refs, f"{self.pool} workers", timeout_s or self.timeout_s)
        if self.then is not None:
            self.then()
        return self.workers


class NodeLost(RuntimeError):
    """The node this process pins its pools to left the cluster (one line)."""


_PINNED: dict[str, str] = {}  # {"node": Ray node id} while this process pins its pools


def pin_to_node(node_id: str | None) -> None:
    """Every pool this process starts from now on (replacements too) runs on `node_id`:
    Ray's node affinity, hard (never spilled elsewhere); None places them as Ray likes."""
    _PINNED.clear()
    if node_id is not None:
        _PINNED["node"] = node_id


def _placed(opts: dict[str, Any], count: int, pool: str) -> dict[str, Any]:
    """`opts` with the pinned node's affinity, after refusing a pool that cannot fit there:
    one line naming the node, the resource, what the pool needs and what is free."""
    node = _PINNED.get("node")
    if node is None:
        return opts
    import ray
    from ray._private.state import state  # no public per-node view of free resources
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    known = {n["NodeID"]: n for n in ray.nodes()}
    if not known.get(node, {}).get("Alive"):
        ip = known.get(node, {}).get("NodeManagerAddress", "?")
        raise NodeLost(f"node {ip} ({node[:8]}) is gone: no {pool} worker can start there")
    free = state.available_resources_per_node().get(node, {})
    for resource, key in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
        each = opts.get(key) or 0
        if each and each * count > free.get(resource, 0):
            raise UserError(
                f"node {node[:8]}: {count} {pool} worker(s) need {each * count:g} {resource}"
                f" ({count} x {each:g}); {free.get(resource, 0):g} free there"
            )
    return {**opts, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


def _start_pool(
    cls: type,
    pool: str,
    prefix: str,
    opts: dict[str, Any],
    count: int,
    detached: bool,
    timeout_s: float,
    args: Any,
    log_dir: Path | None = None,
) -> Starting:
    """`count` actors of `cls` (its constructor takes `args(worker_id)`), starting; each
    registers in `pool`'s registry once started. With `log_dir`, each writes its output
    to `log_dir/WORKER_ID.log` instead of streaming it to the driver."""
    import ray

    from async_grpo.logs import actor_runtime_env

    ensure_registry(pool)
    opts = _placed(opts, count, pool)
    if detached:
        opts = {**opts, "lifetime": "detached"}
    actor = ray.remote(cls)
    env = opts.get("runtime_env")
    workers = [
        actor.options(
            max_concurrency=1000, **{**opts, "runtime_env": actor_runtime_env(env, log_dir, wid)}
        ).remote(*args(wid))
        for wid in worker_ids(prefix, count)
    ]
    return Starting(pool, workers, [w.start.remote() for w in workers], timeout_s)


def serving_adapters(cfg: RunConfig) -> AdapterServing | None:
    """How a run's generation workers serve adapters: None unless the trainer pushes LoRA
    adapters; else one slot per version a request may still use (the staleness bound,
    the version being loaded, and one to spare)."""
    lora = cfg.trainer.lora
    if not lora.rank or lora.push != "adapter":
        return None
    return AdapterServing(lora.rank, cfg.batcher.max_off_policy_steps + 3)


def start_generation_workers(*args: Any, **kwargs: Any) -> list[Any]:
    """Start `count` vLLM workers on this cluster and register them; returns their handles
    (the arguments of `begin_generation_workers`)."""
    return begin_generation_workers(*args, **kwargs).wait()


def begin_generation_workers(
    model_dir: str,
    cfg: GenerationConfig,
    count: int,
    device: str = "cpu",
    detached: bool = False,
    timeout_s: float = START_TIMEOUT_S,
    log_dir: Path | None = None,
    adapters: AdapterServing | None = None,
) -> Starting:
    """`count` vLLM workers, starting (tens of seconds on CPU); with `adapters`, serving
    LoRA adapters (see `serving_adapters`)."""
    from async_grpo.inference.engine_args import vllm_env
    from async_grpo.inference.generation import GenerationWorker

    opts = {
        "num_cpus": cfg.threads if device == "cpu" else 1,
        "num_gpus": cfg.tensor_parallel_size if device == "cuda" else 0,
        "runtime_env": {"env_vars": vllm_env(cfg, device)},
        "max_restarts": 0,
    }
    return _start_pool(
        GenerationWorker,
        "generation",
        "gen",
        opts,
        count,
        detached,
        timeout_s,
        lambda wid: (model_dir, cfg, wid, device, adapters),
        log_dir,
    )


def start_logprob_workers(*args: Any, **kwargs: Any) -> list[Any]:
    """Start `count` transformers log-prob workers and register them (the arguments of
    `begin_logprob_workers`)."""
    return begin_logprob_workers(*args, **kwargs).wait()


def begin_logprob_workers(
    model_dir: str,
    cfg: LogprobConfig,
    count: int,
    device: str = "cpu",
    temperature: float = 1.0,
    detached: bool = False,
    timeout_s: float = START_TIMEOUT_S,
    log_dir: Path | None = None,
) -> Starting:
    """`count` transformers log-prob workers, starting."""
    from async_grpo.inference.logprob import LogprobWorker

    opts = {
        "num_cpus": cfg.threads if device == "cpu" else 1,
        "num_gpus": 1 if device == "cuda" else 0,
        "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(cfg.threads)}},
    }
    return _start_pool(
        LogprobWorker,
        "logprob",
        "lp",
        opts,
        count,
        detached,
        timeout_s,
        lambda wid: (model_dir, cfg, wid, device, temperature),
        log_dir,
    )


def begin_judge_workers(
    model_dir: str,
    cfg: JudgeConfig,
    count: int,
    device: str = "cpu",
    detached: bool = False,
    timeout_s: float = START_TIMEOUT_S,
    log_dir: Path | None = None,
) -> Starting:
    """`count` vLLM judge workers serving `model_dir` (rewards/judge.py), starting."""
    from async_grpo.inference.engine_args import vllm_env
    from async_grpo.rewards.judge import JudgeWorker, engine_config

    opts = {
        "num_cpus": cfg.threads if device == "cpu" else 1,
        "num_gpus": 1 if device == "cuda" else 0,
        "runtime_env": {"env_vars": vllm_env(engine_config(cfg), device)},
        "max_restarts": 0,
    }
    return _start_pool(
        JudgeWorker,
        "judge",
        "judge",
        opts,
        count,
        detached,
        timeout_s,
        lambda wid: (model_dir, cfg, wid, device),
        log_dir,
    )


def begin_reward_model_workers(
    model_dir: str,
    cfg: RewardModelConfig,
    count: int,
    device: str = "cpu",
    detached: bool = False,
    timeout_s: float = START_TIMEOUT_S,
    log_dir: Path | None = None,
) -> Starting:
    """`count` transformers reward-model workers (rewards/reward_model.py), starting."""
    from async_grpo.rewards.reward_model import RewardModelWorker

    opts = {
        "num_cpus": cfg.threads if device == "cpu" else 1,
        "num_gpus": 1 if device == "cuda" else 0,
        "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(cfg.threads)}},
    }
    return _start_pool(
        RewardModelWorker,
        "reward_model",
        "rm",
        opts,
        count,
        detached,
        timeout_s,
        lambda wid: (model_dir, cfg, wid, device),
        log_dir,
    )


def model_reward_starters(cfg: RunConfig, logs: Path | None) -> dict[str, Callable[[int], Any]]:
    """What starts n workers of each model reward's pool (judge, reward model)."""
    from async_grpo.models import resolve_model

    v, device = cfg.verifier, cfg.trainer.device
    starters: dict[str, Callable[[int], Any]] = {}
    if v.judge.model:
        judge_dir = str(resolve_model(v.judge.model))
        starters["judge"] = lambda n: begin_judge_workers(
            judge_dir, v.judge, n, device, log_dir=logs
        )
    if v.reward_model.model:
        rm_dir = str(resolve_model(v.reward_model.model))
        starters["reward_model"] = lambda n: begin_reward_model_workers(
            rm_dir, v.reward_model, n, device, log_dir=logs
        )
    return starters


def stop_workers(workers: list[Any], drain_timeout_s: float = 30.0) -> None:
    """Drain then kill: the two-phase stop (no orphan engines). Every registry forgets
    them, also the workers that do not deregister themselves (verifiers)."""
    import ray

    refs = [w.stop.remote(drain_timeout_s) for w in workers]
    ray.wait(refs, num_returns=len(refs), timeout=drain_timeout_s + 30)
    registries = []
    for pool in POOLS:
        with contextlib.suppress(ValueError):
            registries.append(ray.get_actor(registry_name(pool), namespace=NAMESPACE))
    forgotten = [r.deregister_handles.remote(workers) for r in registries]
    if forgotten:
        _, late = ray.wait(forgotten, num_returns=len(forgotten), timeout=30)
        if late:
            print(f"{len(late)} registries did not deregister stopped workers in 30s", flush=True)
    for w in workers:
        ray.kill(w)


def start_verifier_workers(*args: Any, **kwargs: Any) -> list[Any]:
    """Start verifier actors and register them (the arguments of `begin_verifier_workers`)."""
    return begin_verifier_workers(*args, **kwargs).wait()


def begin_verifier_workers(
    cfg: VerifierConfig,
    count: int,
    detached: bool = False,
    timeout_s: float = 120.0,
    log_dir: Path | None = None,
) -> Starting:
    """`count` verifier actors, starting; registered in the `verifier` registry once up.

    Capacity is in samples queued per worker; each worker scores `cfg.max_concurrency`
    at a time in sandbox subprocesses (those do the CPU work, so the actor reserves none).
    """
    from async_grpo.rewards.pool import VerifierWorker

    return _start_silent_pool(
        VerifierWorker,
        "verifier",
        "verify",
        count,
        VERIFIER_CAPACITY,
        detached,
        timeout_s,
        lambda wid: (cfg,),
        log_dir,
        max_concurrency=64,
    )


def start_environment_workers(*args: Any, **kwargs: Any) -> list[Any]:
    """Start environment workers and register them (the arguments of
    `begin_environment_workers`)."""
    return begin_environment_workers(*args, **kwargs).wait()


def begin_environment_workers(
    cfg: EnvironmentConfig,
    count: int,
    detached: bool = False,
    timeout_s: float = 120.0,
    log_dir: Path | None = None,
) -> Starting:
    """`count` environment workers, starting; registered in the `environment` registry
    once up, each with room for `cfg.capacity` live instances (episodes)."""
    from async_grpo.environments.pool import EnvironmentWorker

    return _start_silent_pool(
        EnvironmentWorker,
        "environment",
        "env",
        count,
        cfg.capacity,
        detached,
        timeout_s,
        lambda wid: (cfg, wid),
        log_dir,
        max_concurrency=max(64, 2 * cfg.capacity),
    )


def _start_silent_pool(
    cls: type,
    pool: str,
    prefix: str,
    count: int,
    capacity: int,
    detached: bool,
    timeout_s: float,
    args: Any,
    log_dir: Path | None,
    max_concurrency: int,
) -> Starting:
    """Actors without heartbeats (their registry pings them): started, then registered
    with the node each one runs on."""
    import ray

    from async_grpo.logs import actor_runtime_env

    registry = ensure_registry(pool)
    opts = _placed({"num_cpus": 0, "max_concurrency": max_concurrency}, count, pool)
    if detached:
        opts["lifetime"] = "detached"
    actor = ray.remote(cls)
    ids = worker_ids(prefix, count)
    workers = [
        actor.options(**opts, runtime_env=actor_runtime_env(None, log_dir, wid)).remote(*args(wid))
        for wid in ids
    ]

    def register() -> None:
        nodes = ray.get([w.__ray_call__.remote(actor_node) for w in workers], timeout=timeout_s)
        ray.get(
            [
                registry.register.remote(wid, w, capacity, 0, node, False)
                for wid, w, node in zip(ids, workers, nodes, strict=True)
            ],
            timeout=timeout_s,
        )

    return Starting(pool, workers, [w.stats.remote() for w in workers], timeout_s, register)
