"""Cluster commands: `worker` (start pool workers on this node), `status`, `stop`.

`async-grpo worker` joins a running Ray cluster, starts workers on this node, registers
them, and stays up until Ctrl-C or `async-grpo stop`; then it drains and exits.
Launching it on every node is how a multi-node cluster is built. Like `async-grpo run` it
names itself (RUN_ID_ENV): its workers' files in /dev/shm (adapter folders) go in one
folder, swept when a dead worker is replaced and when it stops (async_grpo/shm_files.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import signal
import socket
import time
import uuid
from typing import Any

from async_grpo.errors import UserError

POOLS = ("generation", "logprob", "verifier", "environment", "judge", "reward_model")
NO_MODEL = ("verifier", "environment")


def add_cluster_parsers(sub: Any) -> None:
    p = sub.add_parser("worker", help="start pool workers on this Ray node and keep them up")
    p.add_argument("--mode", choices=POOLS, required=True)
    p.add_argument(
        "--model",
        default=None,
        help="model folder or prepared name (not for verifier, environment; judge and"
        " reward_model: default verifier.judge.model, verifier.reward_model.model)",
    )
    p.add_argument("--num-workers", type=int, default=None, help="default: from the config")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--node",
        default=None,
        help="the Ray node to run on: its IP or the start of its node id (default: this one)",
    )
    p.add_argument("--config", default=None, help="YAML config for the pool's settings")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. generation.threads=2")
    p.set_defaults(func=run_worker)

    p = sub.add_parser("status", help="registered workers by node: load, version, heartbeat")
    p.add_argument("--address", default="auto")
    p.add_argument("--json", action="store_true", help="one JSON object per worker, a line each")
    p.set_defaults(func=run_status)

    p = sub.add_parser("stop", help="drain and stop every registered worker")
    p.add_argument("--address", default="auto")
    p.set_defaults(func=run_stop)


def _connect(address: str) -> None:
    from async_grpo.ray_utils import connect

    host, sep, port = address.rpartition(":")
    if sep and port.isdigit():  # fail fast: ray.init retries an absent cluster for minutes
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as e:
            raise UserError(
                f"no Ray cluster at {address!r} ({e.strerror or e}); start one with"
                " `ray start --head --node-ip-address=127.0.0.1 --include-dashboard=false`"
            ) from None
    try:
        connect(address)
    except ConnectionError as e:
        raise UserError(
            f"no Ray cluster at {address!r} ({e}); start one with"
            " `ray start --head --node-ip-address=127.0.0.1 --include-dashboard=false`"
        ) from None


def run_worker(args: argparse.Namespace) -> int:
    from async_grpo.preflight import checked_before_ray
    from async_grpo.preflight.settings import load_config

    cfg = load_config(args.config, args.overrides)
    checked_before_ray(cfg, "worker", mode=args.mode, model=args.model)
    if args.mode in ("judge", "reward_model"):
        args.model = args.model or getattr(cfg.verifier, args.mode).model
    elif args.mode not in NO_MODEL:
        args.model = args.model or cfg.model
    from async_grpo import pools
    from async_grpo.inference.supervisor import PoolSupervisor, RestartLimit, pool_subject
    from async_grpo.pools import NodeLost, stop_workers
    from async_grpo.shm_files import RUN_ID_ENV, remove_orphans, remove_run

    _connect(args.address)
    pools.pin_to_node(_node_id(args.node))
    run_id = os.environ.setdefault(RUN_ID_ENV, f"worker-{uuid.uuid4().hex[:8]}")
    started = time.time()
    workers = _start(args, cfg)
    print(
        f"{len(workers)} {args.mode} worker(s) registered; Ctrl-C or `async-grpo stop` ends them",
        flush=True,
    )
    # a dead worker is replaced, and its files in /dev/shm removed
    sweep = functools.partial(remove_orphans, run_id, since=started)
    supervisor = PoolSupervisor(cfg.max_worker_restarts, sweep=sweep)
    subject = pool_subject(cfg, args.mode, args.model)
    supervisor.watch(args.mode, workers, lambda: _start(args, cfg, 1), subject)
    stop = {"signal": 0}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: stop.update(signal=signum))
    code = 0
    try:
        while not stop["signal"] and not _all_stopping(supervisor.workers):
            time.sleep(1.0)
            for line in supervisor.check():
                print(line, flush=True)
    except (RestartLimit, NodeLost) as e:
        print(str(e), flush=True)
        code = 1
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # stop undisturbed
        signal.signal(sig, signal.SIG_IGN)
    stop_workers(supervisor.workers)
    remove_run(run_id, since=started)
    print(f"{args.mode} workers stopped", flush=True)
    return 128 + stop["signal"] if stop["signal"] else code


def _node_id(name: str | None) -> str:
    """The Ray node id of `--node` (an IP or the start of a node id), or of this node."""
    import ray

    if name is None:
        return ray.get_runtime_context().get_node_id()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    found = [
        n["NodeID"]
        for n in alive
        if name == n.get("NodeManagerAddress") or n["NodeID"].startswith(name)
    ]
    if len(found) != 1:
        known = ", ".join(f"{n.get('NodeManagerAddress')} ({n['NodeID'][:8]})" for n in alive)
        what = "no" if not found else f"{len(found)}"
        raise UserError(f"--node {name}: {what} live Ray node(s) match; the nodes: {known}")
    return found[0]


def _start(args: argparse.Namespace, cfg: Any, n: int | None = None) -> list[Any]:
    from async_grpo import pools

    if args.mode == "verifier":
        n = n or args.num_workers or cfg.verifier.num_workers
        return pools.start_verifier_workers(cfg.verifier, n, detached=False)
    if args.mode == "environment":
        n = n or args.num_workers or cfg.environment.num_workers
        return pools.start_environment_workers(cfg.environment, n, detached=False)
    from async_grpo.models import resolve_model

    model = str(resolve_model(args.model))
    if args.mode == "generation":
        n = n or args.num_workers or cfg.generation.num_workers
        return pools.start_generation_workers(
            model, cfg.generation, n, args.device, adapters=pools.serving_adapters(cfg)
        )
    if args.mode == "judge":
        n = n or args.num_workers or cfg.verifier.judge.num_workers
        return pools.begin_judge_workers(model, cfg.verifier.judge, n, args.device).wait()
    if args.mode == "reward_model":
        n = n or args.num_workers or cfg.verifier.reward_model.num_workers
        return pools.begin_reward_model_workers(
            model, cfg.verifier.reward_model, n, args.device
        ).wait()
    n = n or args.num_workers or cfg.logprob.num_workers
    return pools.start_logprob_workers(
        model, cfg.logprob, n, args.device, cfg.trainer.loss.temperature
    )


def _all_stopping(workers: list[Any]) -> bool:
    """Every worker was told to stop (`async-grpo stop`); a dead one is not: the
    supervisor replaces it."""
    import ray

    for w in workers:
        try:
            if not ray.get(w.ping.remote(), timeout=30).get("stopping", False):
                return False
        except Exception:  # dead or unreachable: not a stop
            return False
    return True


def _registries() -> dict[str, Any]:
    import ray

    from async_grpo.ray_utils import NAMESPACE, registry_name

    found = {}
    for pool in POOLS:
        with contextlib.suppress(ValueError):
            found[pool] = ray.get_actor(registry_name(pool), namespace=NAMESPACE)
    return found


def run_status(args: argparse.Namespace) -> int:
    import ray

    _connect(args.address)
    rows = []
    for registry in _registries().values():
        rows += ray.get(registry.status.remote(), timeout=30)
    if args.json:
        for r in rows:
            print(json.dumps(dataclasses.asdict(r)))
        return 0
    if not rows:
        print("no workers registered")
        return 0
    for node in sorted({r.node for r in rows}):
        mine = [r for r in rows if r.node == node]
        pools = sorted({r.pool for r in mine})
        print(f"{node or 'node unknown'}: {len(mine)} worker(s) of {', '.join(pools)}")
        print(
            f"  {'pool':<11} {'worker':<22} {'load':>9} {'version':>7} {'weights by':<10}  heartbeat"
        )
        for r in mine:
            print(
                f"  {r.pool:<11} {r.worker_id:<22} {r.load:>4}/{r.capacity:<4} {r.version:>7}"
                f" {r.transport or '-':<10}  {r.seconds_since_heartbeat}s ago"
            )
    return 0


def run_stop(args: argparse.Namespace) -> int:
    import ray
    from ray.exceptions import RaySystemError

    _connect(args.address)
    n = 0
    for pool, registry in _registries().items():
        try:
            handles = ray.get(registry.handles.remote(), timeout=30)
        except RaySystemError as e:  # a handle of an actor whose job ended cannot be read
            print(f"pool {pool!r}: cannot read its workers' handles ({e}); skipped", flush=True)
            continue
        refs = [h.stop.remote(30.0) for h in handles.values()]
        _, late = ray.wait(refs, num_returns=len(refs), timeout=60)
        if late:
            print(f"pool {pool!r}: {len(late)} worker(s) did not drain within 60s", flush=True)
        ray.get([registry.deregister.remote(wid) for wid in handles], timeout=30)
        n += len(refs)
    print(f"asked {n} worker(s) to drain and stop")
    return 0
