"""vLLM-CPU engine processes: the model in a worker process of its own (vLLM's default on
CPU) or in the engine-core process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, our choice).

    .venv/bin/python bench/engine_start.py [--threads 2] [--model smollm2-135m] [--repeats 2]

Starts the `AsyncLLM` a generation worker starts (eager, the dtype `auto` picks, our
weight-transfer extension), in a fresh process per measurement, and times: importing
vLLM, the engine's start, generation (64 prompts x 48 sampled tokens, after a warm-up) and
its shutdown. Every run and test of the project starts engines, so their start is paid
dozens of times a test session; generation speed must not pay for it.

Prints one JSON line per measurement (with the CPU kind).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def measure(model: str, threads: int) -> dict[str, object]:
    t0 = time.perf_counter()
    import torch
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from async_grpo.models import in_dtype, resolve_model
    from async_grpo.precision import resolve_dtype

    imported = time.perf_counter() - t0
    dtype = resolve_dtype("auto", "cpu").dtype  # as a run picks it on this CPU
    model_dir = in_dtype(resolve_model(model), dtype)
    t = time.perf_counter()
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(model_dir),
            dtype=dtype,
            max_model_len=256,
            max_num_seqs=64,
            enforce_eager=True,
            seed=0,
            logprobs_mode="processed_logprobs",
            worker_extension_cls="async_grpo.inference.vllm_ext.WeightSyncExtension",
            weight_transfer_config={"backend": "async_grpo"},
            disable_log_stats=True,
            enable_chunked_prefill=False,
            max_num_batched_tokens=4096,
        )
    )
    started = time.perf_counter() - t
    prompts = [f"What is {a} + {b}? Answer:" for a in range(8) for b in range(8)]

    async def generate(batch: list[str]) -> int:
        async def one(i: int, prompt: str) -> int:
            params = SamplingParams(max_tokens=48, temperature=1.0, seed=i, ignore_eos=True)
            final = None
            async for out in engine.generate(prompt, params, request_id=f"{time.time()}-{i}"):
                final = out
            return len(final.outputs[0].token_ids)

        return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(batch))))

    async def rates() -> list[float]:
        await generate(prompts[:8])  # warm-up
        found = []
        for _ in range(2):
            t = time.perf_counter()
            tokens = await generate(prompts)
            found.append(tokens / (time.perf_counter() - t))
        return found

    tok_s = asyncio.run(rates())
    t = time.perf_counter()
    engine.shutdown()
    return {
        "model_in_engine_core": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0",
        "model": model,
        "dtype": dtype,
        "threads": threads,
        "import_s": round(imported, 1),
        "start_s": round(started, 1),
        "gen_tok_s": [round(r, 1) for r in tok_s],
        "shutdown_s": round(time.perf_counter() - t, 1),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m", help="a name or a model folder")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # one engine per process, as a worker has
        print(json.dumps(measure(args.model, args.threads)), flush=True)
        return
    for _ in range(args.repeats):
        for in_core in ("1", "0"):
            env = {
                **os.environ,
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_core == "0" else "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "OMP_NUM_THREADS": str(args.threads),
            }
            cmd = [sys.executable, __file__, "--one", "--model", args.model]
            r = subprocess.run(
                [*cmd, "--threads", str(args.threads)],
                capture_output=True,
                text=True,
                timeout=900,
                env=env,
            )
            lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
            if r.returncode != 0 or not lines:
                sys.exit(f"bench/engine_start.py: a measurement failed:\n{r.stderr[-3000:]}")
            print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
