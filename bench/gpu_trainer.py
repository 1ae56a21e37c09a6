"""The trainer step on one device: tokens/s, samples/s, MFU and peak memory, one JSON line
per figure (model x row length x attention backend x shared/unshared prompts).

    python bench/gpu_trainer.py                          # on an H100: the docs' table
    python bench/gpu_trainer.py --device cpu --models tiny --rows 512 --steps 1   # smoke

What runs is the trainer's own path: `build_policy` (FSDP2 on one rank, fp32 masters, the
`auto` compute dtype, activation checkpointing per `--ac`), the attention backend's
`prepare`, the chunked LM head, the GRPO loss, backward and an AdamW step. Models are built
from configs with random weights (no download): SmolLM2-135M and Qwen2.5-1.5B shapes.
Rows are filled with GRPO groups of 8 (prompt 150 tokens, completions 100..500, seeded);
`shared` packs each group's prompt once. MFU = 6 * params * row tokens / step time / peak
(989 TFLOP/s, H100 SXM dense bf16), attention FLOPs excluded, as in the issue's table.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import random
import socket
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

PEAK_FLOPS = {"cuda": 989e12}  # no peak is stated for the CPUs here: MFU is null there
SHAPES = {
    "smollm2-135m": dict(
        kind="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
    ),
    "qwen2.5-1.5b": dict(
        kind="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
    ),
    "tiny": dict(
        kind="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=1, num_key_value_heads=1, vocab_size=49152,
    ),
}  # fmt: skip


def model_folder(name: str, root: str) -> str:
    """A folder with random weights in `name`'s shapes (tied embeddings, bias-free head)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    shape = dict(SHAPES[name])
    cls = Qwen2Config if shape.pop("kind") == "qwen2" else LlamaConfig
    config = cls(**shape, tie_word_embeddings=True, max_position_embeddings=131072)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = os.path.join(root, name)
    model.save_pretrained(path)
    return path


def groups_for_row(row_tokens: int, vocab: int, share: bool, seed: int = 0) -> list:
    """GRPO groups of 8 (prompt 150, completions 100..500 tokens) filling up to a row."""
    from async_grpo.core.packing import PackInput, packed_tokens

    rng = random.Random(seed)
    samples: list[PackInput] = []
    while True:
        prompt = [rng.randrange(vocab) for _ in range(150)]
        group = []
        for _ in range(8):
            n = rng.randint(100, 500)
            group.append(
                PackInput(prompt, [rng.randrange(vocab) for _ in range(n)], 1.0, [-1.0] * n)
            )
            group[-1].advantage = rng.choice([-1.0, 1.0])
        if packed_tokens(samples + group, share) > row_tokens:
            return samples or group[:1]
        samples += group


def phase_seconds(policy, batch, loss_fn, opt, sync) -> dict[str, float]:
    """One more step, timed per phase (forward with the loss, backward, optimizer)."""
    marks = [time.perf_counter()]
    logp, _ = policy(batch, False)
    loss, _ = loss_fn(logp, batch, 1, 1, None, 1)
    sync()
    marks.append(time.perf_counter())
    loss.backward()
    sync()
    marks.append(time.perf_counter())
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    marks.append(time.perf_counter())
    names = ("forward_s", "backward_s", "optimizer_s")
    return {n: round(b - a, 4) for n, a, b in zip(names, marks, marks[1:], strict=False)}


def one_figure(
    args, name: str, folder: str, rows: int, attention: str, share: bool, ac: bool | None
) -> dict:
    import torch

    from async_grpo.config import LossConfig, TrainerConfig
    from async_grpo.core.attention import select_attention
    from async_grpo.core.loss import build_loss
    from async_grpo.core.packing import pack
    from async_grpo.trainer.model import build_optimizer, build_policy

    device = torch.device(args.device)
    backend, why = select_attention(attention, args.device, share, True, rows)
    cfg = TrainerConfig(
        lr=1e-6,
        compute_dtype="auto",
        activation_checkpointing=ac,
        attention=attention,
        logprob_chunk_size=args.chunk,
    )
    policy = build_policy(folder, cfg, device, 1, backend)
    opt, _ = build_optimizer(policy, cfg)
    loss_fn = build_loss(LossConfig(), 512)
    samples = groups_for_row(rows, SHAPES[name]["vocab_size"], share)
    batch = backend.prepare(pack(samples, share_prompts=share)).to(device)
    params = sum(p.numel() for p in policy.parameters())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def step() -> None:
        logp, _ = policy(batch, False)
        loss, _ = loss_fn(logp, batch, 1, 1, None, 1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / args.steps
    tokens = batch.input_ids.shape[1]
    fig = {
        "model": name,
        "row_tokens": tokens,
        "attention": backend.name,
        "attention_reason": why,
        "shared_prompts": share,
        "samples": len(samples),
        "compute_dtype": policy.precision.dtype,
        "activation_checkpointing": policy.checkpointing,
        "logprob_chunk_size": args.chunk,
        "tok_per_s": round(tokens / dt, 1),
        "samples_per_s": round(len(samples) / dt, 2),
        "mfu": round(6 * params * tokens / dt / PEAK_FLOPS[device.type], 4)
        if device.type in PEAK_FLOPS
        else None,
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if device.type == "cuda"
        else None,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else cpu_name(),
    }
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fig["phases"] = phase_seconds(policy, batch, loss_fn, opt, sync)
    return fig


def cpu_name() -> str:
    from async_grpo.precision import cpu_kind

    return f"cpu {cpu_kind()}"


def main() -> None:
    import torch
    import torch.distributed as dist

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-1.5b")
    ap.add_argument("--rows", default="4096,16384,32768,65536")
    ap.add_argument("--attention", default="sdpa,flex,flash")
    ap.add_argument("--share", default="false,true")
    ap.add_argument("--ac", default="auto", help="activation checkpointing: auto,true,false")
    ap.add_argument("--chunk", type=int, default=1024, help="trainer.logprob_chunk_size")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=600),
    )
    with tempfile.TemporaryDirectory() as root:
        for name in args.models.split(","):
            folder = model_folder(name, root)
            for rows in map(int, args.rows.split(",")):
                for attention in args.attention.split(","):
                    for share, ac in itertools.product(
                        [s == "true" for s in args.share.split(",")],
                        [None if a == "auto" else a == "true" for a in args.ac.split(",")],
                    ):
                        try:
                            fig = one_figure(args, name, folder, rows, attention, share, ac)
                        except ValueError as e:  # a backend that cannot run here
                            fig = {"model": name, "row_tokens": rows, "attention": attention,
                                   "shared_prompts": share, "skipped": str(e)}  # fmt: skip
                        except torch.OutOfMemoryError:
                            fig = {"model": name, "row_tokens": rows, "attention": attention,
                                   "shared_prompts": share, "error": "out of memory"}  # fmt: skip
                        if args.device == "cuda":
                            torch.cuda.empty_cache()
                        print(json.dumps(fig), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
