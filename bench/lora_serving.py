"""LoRA in vLLM-CPU: push bytes and seconds (adapter vs full weights), and generation
tok/s with an adapter vs the base.

    .venv/bin/python bench/lora_serving.py [--rank 16] [--pushes 5] [--prompts 64]

SmolLM2-135M, engine dtype `auto` (as a run uses), shared-memory pushes from this process
(trainer rank 0's `WeightPusher` over the unsharded model). Two engines, one after the
other: a plain one (full-weight pushes; base tok/s) and one serving adapters (adapter
pushes of rank `--rank` on every linear layer; tok/s with the adapter). The adapter engine
runs our per-adapter CPU LoRA ops (inference/cpu_lora.py); `--vllm-ops` keeps vLLM's own
for the comparison. Generation: `--prompts` arithmetic prompts x 8 samples x 48 tokens,
temperature 1, all at once, as a run's step sends them. Prints one JSON line per figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _emit(**fields: object) -> None:
    import torch

    fields["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    print(json.dumps(fields), flush=True)


def _tok_per_s(worker: object, prompts: list[list[int]]) -> tuple[float, float]:
    """(tokens per second, seconds) of every prompt's 8 samples at once."""
    import ray

    from async_grpo.inference.types import SamplingSettings

    s = SamplingSettings(max_new_tokens=48, temperature=1.0, seed=1)
    t = time.perf_counter()
    outs = ray.get([worker.generate.remote(p, 8, s) for p in prompts], timeout=1800)
    dt = time.perf_counter() - t
    return sum(len(c.token_ids) for o in outs for c in o) / dt, dt


def _policy(model_dir: str, rank: int) -> object:
    import torch
    from transformers import AutoModelForCausalLM

    from async_grpo import adapters
    from async_grpo.config import LoraConfig
    from async_grpo.trainer import lora

    policy = torch.nn.Module()
    policy.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if rank:
        cfg = LoraConfig(rank=rank)
        policy.lora = cfg
        policy.adapter_config = lora.adapter_config_dict(adapters.inject(policy.hf, cfg))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n, p in policy.hf.named_parameters():
                if ".lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    with torch.no_grad():  # resident before measuring
        sum(float(p.sum()) for p in policy.parameters())
    return policy


def measure(kind: str, rank: int, pushes: int, prompts: list[list[int]], model_dir: str) -> None:
    from async_grpo.config import GenerationConfig
    from async_grpo.inference.types import AdapterServing
    from async_grpo.pools import start_generation_workers, stop_workers
    from async_grpo.trainer.push import WeightPusher

    cfg = GenerationConfig(max_model_len=256, max_concurrent_seqs=512, kv_cache_gib=2, threads=2)
    serving = AdapterServing(rank, 3) if kind != "base" else None
    (worker,) = start_generation_workers(model_dir, cfg, 1, adapters=serving)
    try:
        policy = _policy(model_dir, rank if serving else 0)
        pusher = WeightPusher(policy, rank=0, transport="shm", timeout_s=600)
        pusher.push(1)
        runs = [pusher.push(2 + i) for i in range(pushes)]
        _emit(
            figure=f"push, {'adapter' if serving else 'full weights'}",
            model="SmolLM2-135M",
            lora_rank=rank if serving else 0,
            bytes=int(runs[0]["weight_push_bytes"]),
            push_s=round(statistics.median(r["time/weight_push"] for r in runs), 3),
        )
        _tok_per_s(worker, prompts[:4])  # warm-up
        tps, secs = _tok_per_s(worker, prompts)
        _emit(figure=f"generation, {kind}", tok_per_s=round(tps, 1), seconds=round(secs, 1))
        pusher.close()
    finally:
        stop_workers([worker], drain_timeout_s=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--pushes", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--vllm-ops", action="store_true", help="also vLLM's own CPU LoRA ops")
    args = ap.parse_args()

    from async_grpo.data import load_prompts
    from async_grpo.data.tokenize import tokenize_prompts
    from async_grpo.models import resolve_model
    from async_grpo.ray_utils import connect

    model_dir = str(resolve_model("smollm2-135m"))
    rows = load_prompts("sample-data/arithmetic.jsonl")[: args.prompts]
    prompts = [p.input_token_ids for p in tokenize_prompts(rows, model_dir, "chat")]
    connect(None, num_cpus=4, object_store_bytes=256 << 20)
    measure("base", args.rank, args.pushes, prompts, model_dir)
    measure("adapter", args.rank, args.pushes, prompts, model_dir)
    if args.vllm_ops:
        os.environ["ASYNC_GRPO_VLLM_LORA_OPS"] = "1"  # read by vllm_ext in the engine
        measure("adapter, vLLM's ops", args.rank, args.pushes, prompts, model_dir)


if __name__ == "__main__":
    main()
