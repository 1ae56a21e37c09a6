"""Trainer step time and peak memory, LoRA against full fine-tuning, on the real trainer
path (FSDP2 on one gloo rank, the packed forward, the GRPO loss, AdamW).

    python bench/lora_trainer.py [--rank 16] [--tokens 512] [--minibatches 4] [--threads 2]

SmolLM2-135M, compute dtype `auto` (bf16 where the CPU has it natively), fp32 masters.
Each setting runs 1 warm-up step and 3 timed ones of `minibatches` rows of `tokens`
tokens; it prints the median step time, the time of the base's reference forward
(LoRA with a KL term), the process's peak RSS growth and the trained parameters."""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time
from dataclasses import replace

import torch


def _samples(n_rows: int, tokens: int, seed: int = 0) -> list:
    from async_grpo.core.packing import PackInput

    rng = random.Random(seed)
    out = []
    for _ in range(n_rows * (tokens // 64)):
        behaviour = [-rng.uniform(1.0, 3.0) for _ in range(40)]
        out.append(
            PackInput(
                prompt_ids=[rng.randrange(49152) for _ in range(24)],
                completion_ids=[rng.randrange(49152) for _ in range(40)],
                advantage=rng.uniform(-1, 1),
                behaviour_logprobs=behaviour,
            )
        )
    return out


def _run(model_dir: str, rank: int, kl: float, args: argparse.Namespace) -> dict:
    from async_grpo.batcher.types import EndOfBatch, Minibatch
    from async_grpo.config import LoraConfig, LossConfig, RunConfig, TrainerConfig
    from async_grpo.core.loss import loss_counts
    from async_grpo.core.packing import pack
    from async_grpo.trainer.loop import Trainer
    from async_grpo.trainer.model import build_optimizer, build_policy

    t = TrainerConfig(
        lr=1e-5,
        max_steps=100,
        push_every=1000,
        loss=LossConfig(kl_coef=kl),
        lora=LoraConfig(rank=rank),
    )
    cfg = replace(RunConfig(), trainer=t)
    cpu = torch.device("cpu")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    policy = build_policy(model_dir, t, cpu, 1)
    opt, sched = build_optimizer(policy, t)
    rows = _samples(args.minibatches, args.tokens)
    per_row = len(rows) // args.minibatches

    class Batcher:
        def __init__(self, step: int) -> None:
            tokens, count = loss_counts(pack(rows), False)
            self.items = [
                Minibatch(step, rows[i * per_row : (i + 1) * per_row], args.tokens, last=True)
                for i in range(args.minibatches)
            ] + [EndOfBatch(step, tokens, count, args.minibatches, {})]

        def next(self) -> object:
            return self.items.pop(0)

        def set_version(self, version: int) -> None:
            pass

    times, refs = [], []
    for step in range(4):
        tr = Trainer(cfg, policy, opt, sched, Batcher(step), model_dir, cpu)
        t0 = time.perf_counter()
        record = tr.step(step)
        if step:
            times.append(time.perf_counter() - t0)
            refs.append(record["time/reference"])
    trained = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "step_s": statistics.median(times),
        "reference_s": statistics.median(refs),
        "peak_rss_growth_mib": (rss - rss0) / 1024,
        "trained_params": trained,
        "compute": policy.precision.describe(),
    }


def main() -> None:
    import multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from async_grpo.precision import cpu_kind

    print(f"cpu: {cpu_kind()}; {args.minibatches} rows of {args.tokens} tokens a step")
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        r = pool.apply(_logprob_worker_child, (args,))
    print(
        f"logprob worker: the same rows' reference log-probs in {r['seconds']:.2f} s a step"
        f" ({r['dtype']}), its own model copy {r['model_mib']:.0f} MiB",
        flush=True,
    )
    # one process per setting: peak RSS is its own
    for name, rank, kl in (
        ("full", 0, 0.0),
        ("lora", args.rank, 0.0),
        ("lora+kl", args.rank, 0.01),
    ):
        with ctx.Pool(1) as pool:
            r = pool.apply(_child, (name, rank, kl, args))
        print(
            f"{name:8s} step {r['step_s']:.2f} s (reference forward {r['reference_s']:.2f} s),"
            f" peak RSS growth {r['peak_rss_growth_mib']:.0f} MiB,"
            f" trained parameters {r['trained_params'] / 1e6:.2f} M, computes in {r['compute']}",
            flush=True,
        )


def _logprob_worker_child(args: argparse.Namespace) -> dict:
    """What a logprob worker does for the same rows: a no-grad forward of its own copy of
    the model (transformers, the compute dtype `auto` picks here)."""
    from transformers import AutoModelForCausalLM

    from async_grpo.core.logprobs import batch_logprobs
    from async_grpo.core.packing import pack
    from async_grpo.models import resolve_model
    from async_grpo.precision import resolve_dtype

    torch.set_num_threads(args.threads)
    dtype = resolve_dtype("auto", "cpu").torch_dtype
    model = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m"), dtype=dtype)
    model.config.use_cache = False
    rows = _samples(args.minibatches, args.tokens)
    per_row = len(rows) // args.minibatches
    batches = [pack(rows[i * per_row : (i + 1) * per_row]) for i in range(args.minibatches)]
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        with torch.no_grad():
            for b in batches:
                batch_logprobs(model, b, 1.0, 1024, False)
        times.append(time.perf_counter() - t0)
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return {"seconds": statistics.median(times[1:]), "dtype": str(dtype), "model_mib": size}


def _child(name: str, rank: int, kl: float, args: argparse.Namespace) -> dict:
    import datetime
    import os
    import socket

    import torch.distributed as dist

    from async_grpo.models import resolve_model

    torch.set_num_threads(args.threads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    try:
        return _run(str(resolve_model("smollm2-135m")), rank, kl, args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
