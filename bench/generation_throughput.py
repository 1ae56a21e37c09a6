"""Output tokens/s through registry + Ray worker vs the raw vLLM engine, and logprob tokens/s.

    .venv/bin/python bench/generation_throughput.py [--prompts 32] [--n 4] [--tokens 64]

Same model (SmolLM2-135M, bf16, eager), same prompts, same seeds, one engine each time.
Goal: pool / raw >= 0.9.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # the same for both engines


def prompts_for(model_dir: str, k: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from async_grpo.data.generate import countdown_rows
    from async_grpo.data.tokenize import chat_token_ids

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [chat_token_ids(tok, r["input"]) for r in countdown_rows(k, seed=0)]


async def raw_engine(model_dir: str, cfg, prompts, n: int, tokens: int) -> float:
    from vllm import AsyncEngineArgs, SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from async_grpo.inference.engine_args import cpu_scheduler_args

    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=model_dir,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_concurrent_seqs,
            enforce_eager=True,
            seed=0,
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
            **cpu_scheduler_args(cfg, "cpu"),
        )
    )

    async def one(i: int, p: list[int]) -> int:
        params = SamplingParams(
            n=n,
            max_tokens=tokens,
            temperature=1.0,
            seed=i,
            logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        final = None
        async for out in engine.generate(
            TokensPrompt(prompt_token_ids=p), params, uuid.uuid4().hex
        ):
            final = out
        return sum(len(o.token_ids) for o in final.outputs)

    await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts[:4])])  # warm-up
    t = time.perf_counter()
    total = sum(await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)]))
    rate = total / (time.perf_counter() - t)
    engine.shutdown()
    return rate


async def through_pool(prompts, n: int, tokens: int) -> float:
    from async_grpo.inference.client import PoolClient
    from async_grpo.inference.types import SamplingSettings

    client = PoolClient("generation")

    async def one(i: int, p: list[int]) -> int:
        out = await client.call(n, "generate", p, n, SamplingSettings(tokens, 1.0, 1.0, seed=i))
        return sum(len(c.token_ids) for c in out)

    await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts[:4])])
    t = time.perf_counter()
    total = sum(await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)]))
    return total / (time.perf_counter() - t)


async def logprob_rate(prompts, n: int, tokens: int) -> float:
    from async_grpo.inference.client import PoolClient

    client = PoolClient("logprob")
    pairs = [(p, list(range(100, 100 + tokens))) for p in prompts for _ in range(n)]
    t = time.perf_counter()
    await asyncio.gather(*[client.call(1, "logprobs", [pair]) for pair in pairs])
    return sum(len(p) + len(c) for p, c in pairs) / (time.perf_counter() - t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    from async_grpo.config import GenerationConfig, LogprobConfig
    from async_grpo.models import resolve_model

    model_dir = str(resolve_model("smollm2-135m"))
    cfg = GenerationConfig(max_model_len=512, max_concurrent_seqs=256, kv_cache_gib=1, threads=2)
    prompts = prompts_for(model_dir, args.prompts)
    os.environ["OMP_NUM_THREADS"] = "2"
    raw = asyncio.run(raw_engine(model_dir, cfg, prompts, args.n, args.tokens))
    print(f"raw vLLM engine:         {raw:7.1f} output tok/s", flush=True)

    import ray

    from async_grpo.pools import start_generation_workers, start_logprob_workers
    from async_grpo.ray_utils import connect

    connect(None, num_cpus=4, object_store_bytes=512 << 20)
    gen = start_generation_workers(model_dir, cfg, 1)
    pooled = asyncio.run(through_pool(prompts, args.n, args.tokens))
    print(f"registry + Ray worker:   {pooled:7.1f} output tok/s", flush=True)
    print(f"ratio pool / raw:        {pooled / raw:7.2f}  (goal >= 0.9)", flush=True)
    for w in gen:
        ray.kill(w)
    # keep the handle: an actor whose handles are all dropped is ended by Ray
    lp_workers = start_logprob_workers(
        model_dir, LogprobConfig(max_tokens_per_batch=2048, threads=2), 1
    )
    lp = asyncio.run(logprob_rate(prompts, args.n, args.tokens))
    print(f"logprob worker (fp32):   {lp:7.1f} tokens/s (prompt + completion)", flush=True)
    del lp_workers
    ray.shutdown()


if __name__ == "__main__":
    main()
