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
import sys
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


def model_folder(name: str, root: str, device: str = "cpu") -> str:
    """A folder with random weights in `name`'s shapes (tied embeddings, bias-free head),
    initialised on `device` (bf16 on CUDA: half the bytes to save and read back)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    shape = dict(SHAPES[name])
    cls = Qwen2Config if shape.pop("kind") == "qwen2" else LlamaConfig
    config = cls(**shape, tie_word_embeddings=True, max_position_embeddings=131072)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
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
    logp, _ = policy(batch, True)  # with entropy, as the trainer
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
    out = {n: round(b - a, 4) for n, a, b in zip(names, marks, marks[1:], strict=False)}
    print(f"# step phases: {out}", file=sys.stderr, flush=True)  # seen even if killed later
    return out


KERNEL_CLASSES = [  # (class, substrings of a CUDA kernel's name), first match wins
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "splitk")),
    ("attention (flex)", ("flex", "triton_tem")),
    ("liger", ("_rms_norm", "rope", "swiglu", "liger", "silu_mul")),
    ("inductor fused", ("triton_poi", "triton_red", "triton_per")),
    ("optimizer", ("multi_tensor", "adam")),
    ("communication", ("nccl",)),
    ("copy/cast", ("copy", "memcpy", "memset", "cat", "fill", "index", "gather", "scatter")),
    ("reduction", ("reduce", "softmax", "logsumexp", "norm")),
    ("elementwise", ("elementwise", "vectorized")),
]


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def profile_step(step, sync, trace: str | None) -> dict:
    """One step under torch.profiler: GPU time per kernel class, the top kernels, and the
    step's wall time beside its kernels' total (launch-bound if the kernels fill little)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        step()
        sync()
        wall_ms = (time.perf_counter() - t) * 1e3
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            acc = by_name.setdefault(e.name, [0.0, 0])
            acc[0] += e.time_range.elapsed_us() / 1e3
            acc[1] += 1
    classes: dict[str, float] = {}
    for n, (ms, _) in by_name.items():
        cls = kernel_class(n)
        classes[cls] = classes.get(cls, 0.0) + ms
    busy = sum(classes.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:20]
    if trace:
        prof.export_chrome_trace(trace)
    return {
        "wall_ms": round(wall_ms, 1),
        "kernel_ms": round(busy, 1),
        "classes_ms": {k: round(v, 1) for k, v in sorted(classes.items(), key=lambda kv: -kv[1])},
        "top_kernels": [[n[:90], round(ms, 2), c] for n, (ms, c) in top],
    }


def one_figure(
    args, name: str, folder: str, rows: int, attention: str, share: bool, ac: bool | None,
    kernels: str = "eager", lora: int = 0,
) -> dict:  # fmt: skip
    import torch

    from async_grpo.config import LoraConfig, LossConfig, TrainerConfig
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
        kernels=kernels,
        lora=LoraConfig(rank=lora),
    )
    t_build = time.perf_counter()
    policy = build_policy(folder, cfg, device, 1, backend)
    build_s = time.perf_counter() - t_build
    print(f"# {name} {rows} {attention} {kernels} lora {lora}: policy built in {build_s:.1f} s",
          file=sys.stderr, flush=True)  # fmt: skip
    opt, _ = build_optimizer(policy, cfg)
    loss_fn = build_loss(LossConfig(), 512)
    samples = groups_for_row(rows, SHAPES[name]["vocab_size"], share)
    batch = backend.prepare(pack(samples, share_prompts=share)).to(device)
    params = sum(p.numel() for p in policy.parameters())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def step() -> None:
        logp, _ = policy(batch, True)  # with entropy, as the trainer
        loss, _ = loss_fn(logp, batch, 1, 1, None, 1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    t_mask = time.perf_counter()
    backend.mask(batch, policy.precision.torch_dtype)  # the first one compiles its builder
    sync()
    mask_s = round(time.perf_counter() - t_mask, 4)
    first = {"mask_s": mask_s, **phase_seconds(policy, batch, loss_fn, opt, sync)}
    first["graphs_compiled"] = counters["stats"]["unique_graphs"] - graphs
    if first["forward_s"] > 10:  # where a long compile went, per compiler stage
        print(torch._dynamo.utils.compile_times(repr="str"), file=sys.stderr, flush=True)
    for _ in range(args.warmup - 1):
        step()
    sync()
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
        "kernels": kernels,
        "lora_rank": lora,
        "trainable_params": sum(p.numel() for p in policy.parameters() if p.requires_grad),
        "build_s": round(build_s, 2),
        "first_step": first,
    }
    fig["phases"] = phase_seconds(policy, batch, loss_fn, opt, sync)
    if args.profile:
        trace = None
        if args.trace_dir:
            tag = f"{name}-{tokens}-{backend.name}-{'shared' if share else 'unshared'}-{kernels}"
            tag += f"-lora{lora}" if lora else ""
            trace = os.path.join(args.trace_dir, f"trace-{tag}.json")
        fig["profile"] = profile_step(step, sync, trace)
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
    ap.add_argument("--kernels", default="eager", help="trainer.kernels: eager,liger,compile")
    ap.add_argument("--lora", default="0", help="trainer.lora.rank: 0 (every weight),16,...")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="steps before timing (>= 1)")
    ap.add_argument("--profile", action="store_true", help="one more step under torch.profiler")
    ap.add_argument("--trace-dir", help="with --profile: write each step's chrome trace here")
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
            folder = model_folder(name, root, args.device)
            for rows in map(int, args.rows.split(",")):
                for attention in args.attention.split(","):
                    for share, ac, kernels, lora in itertools.product(
                        [s == "true" for s in args.share.split(",")],
                        [None if a == "auto" else a == "true" for a in args.ac.split(",")],
                        args.kernels.split(","),
                        map(int, args.lora.split(",")),
                    ):
                        try:
                            fig = one_figure(
                                args, name, folder, rows, attention, share, ac, kernels, lora
                            )
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
