"""Peak memory per trainer rank while the sharded policy is built, for 1 and 2 gloo ranks.

    .venv/bin/python bench/policy_memory.py [--model smollm2-135m] [--ranks 1 2]

Each rank reports how far its memory rose while the policy was built, for the shipped
path (meta device, then each rank reads only its own rows of each tensor) and for the
whole-model-first path (every rank loads the full model, then shards it), which the
trainer used before. Two figures per rank: the rise of peak RSS (ru_maxrss, which also
counts the safetensors pages mapped from the page cache, shared between ranks) and the
rise of private memory (RssAnon, sampled every 5 ms): the memory each rank adds. One
JSON line per (path, ranks), with the CPU kind.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import socket
import tempfile
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _anon_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


class _AnonPeak:
    """Samples this process's private memory until stopped; keeps the peak."""

    def __init__(self) -> None:
        self.peak, self._stop = _anon_mib(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _anon_mib())
            time.sleep(0.005)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _anon_mib())


def _whole_model_first(model_dir: str, cfg, device, world: int):
    """The old path: the full model on every rank, then fully_shard."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from async_grpo.trainer.model import Policy

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = Policy(hf, 1.0, 1024).to(device)
    mesh = init_device_mesh("cpu", (world,))
    for layer in hf.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    return policy


def _rank(rank: int, world: int, port: int, model_dir: str, path: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from async_grpo.config import TrainerConfig
    from async_grpo.trainer.model import build_policy

    torch.set_num_threads(1)
    dist.init_process_group(
        "cpu:gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    cfg = TrainerConfig(compute_dtype="float32")
    before, anon_before = _peak_mib(), _anon_mib()
    sampler = _AnonPeak()
    if path == "meta_sharded":
        policy = build_policy(model_dir, cfg, torch.device("cpu"), world)
    else:
        policy = _whole_model_first(model_dir, cfg, torch.device("cpu"), world)
    anon_rise = sampler.stop() - anon_before
    rise = _peak_mib() - before
    local = sum(p.to_local().numel() * p.element_size() for p in policy.parameters()) / 2**20
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"rise": rise, "anon": anon_rise, "local": local}, f)
    dist.destroy_process_group()


def measure(model_dir: str, world: int, path: str) -> dict:
    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(world, port, model_dir, path, out), nprocs=world, join=True)
        ranks = []
        for r in range(world):
            with open(os.path.join(out, f"{r}.json")) as f:
                ranks.append(json.load(f))
    return {
        "path": path,
        "ranks": world,
        "max_rank_private_mib": round(max(r["anon"] for r in ranks)),
        "max_rank_rss_mib": round(max(r["rise"] for r in ranks)),
        "shard_mib_per_rank": round(ranks[0]["local"]),
        "cpu": torch.backends.cpu.get_cpu_capability(),
    }


def main() -> None:
    from async_grpo.models import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    model_dir = str(resolve_model(args.model))
    for path in ("meta_sharded", "whole_model_first"):
        for world in args.ranks:
            print(json.dumps({"model": args.model, **measure(model_dir, world, path)}), flush=True)


if __name__ == "__main__":
    main()
