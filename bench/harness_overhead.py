"""What an agent harness pays per model turn for going through the run's OpenAI endpoint
(`environment.kind: openai`) rather than calling the generation pool directly: the same
requests, with the same seeds (so the engine samples the same tokens), one at a time and
8 at once, on a real vLLM generation worker (SmolLM2-135M, fp32).

    .venv/bin/python bench/harness_overhead.py --turns 32            # the real engine
    .venv/bin/python bench/harness_overhead.py --turns 256 --instant  # the endpoint alone
    .venv/bin/python bench/harness_overhead.py --turns 256 --instant --verifiers

`--verifiers`: the rollout is a one-turn `verifiers` environment's (`environment.kind:
verifiers`: `verifiers`' own client, rollout state and rubric on top of the endpoint).

Prints one JSON line: the CPU kind, ms a turn direct and through the endpoint (the
harness's thread, its event loop and `openai` client, HTTP on loopback, vLLM's request
model, the chat template and the trajectory's bookkeeping), and the difference, the
median of `--rounds` interleaved rounds. With `--instant` the pool answers at once with
a fixed reply (no Ray, no engine): the difference is then the endpoint's own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUESTION = [{"role": "user", "content": "What is 12 * 34? Answer with the number."}]


async def one_turn(client, row):
    """The harness measured: one chat request, no reward logic."""
    await client.chat.completions.create(model=row["model"], messages=row["prompt"])
    return 0.0


def load_environment():
    """The `--verifiers` rollout: a one-turn environment, a rubric of one function."""
    import verifiers as vf
    from datasets import Dataset

    def zero(completion, **kwargs) -> float:
        return 0.0

    data = Dataset.from_list([{"question": QUESTION[0]["content"], "answer": "408"}])
    return vf.SingleTurnEnv(dataset=data, rubric=vf.Rubric(funcs=[zero]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--instant", action="store_true", help="a pool that answers at once")
    p.add_argument("--verifiers", action="store_true", help="a verifiers environment's rollout")
    args = p.parse_args()

    import ray
    import torch
    from transformers import AutoTokenizer

    from async_grpo.batcher.harness import HarnessRunner
    from async_grpo.config import EnvironmentConfig, GenerationConfig, RunConfig
    from async_grpo.data import Prompt
    from async_grpo.inference.client import PoolClient
    from async_grpo.inference.types import Completion, SamplingSettings
    from async_grpo.models import prepare_smollm2
    from async_grpo.pools import start_generation_workers, stop_workers
    from async_grpo.ray_utils import connect

    model = prepare_smollm2()
    tok = AutoTokenizer.from_pretrained(model)
    gen = GenerationConfig(
        max_model_len=512,
        max_new_tokens=args.max_new_tokens,
        max_concurrent_seqs=16,
        kv_cache_gib=1,
        dtype="float32",
    )
    cfg = RunConfig(
        model=str(model),
        generation=gen,
        environment=EnvironmentConfig(kind="verifiers", name="__main__")
        if args.verifiers
        else EnvironmentConfig(kind="openai", rollout="__main__:one_turn"),
    )
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False).input_ids  # as the endpoint renders it
    prompt = Prompt(QUESTION[0]["content"], "408", list(ids), messages=QUESTION)
    n = args.turns

    def seed(i: int) -> int:  # the seed the runner gives sample 0, turn 0 of group seed i
        return random.Random(f"{i}:0:0").getrandbits(31)

    class Instant:
        """A pool that answers every request at once with the same 16 tokens."""

        reply = tok("It is 408.", add_special_tokens=False).input_ids + [tok.eos_token_id]

        async def call(self, n, method, ids, n2, sampling, on_retry=None, min_version=-1):
            return [Completion(self.reply, [-0.1] * len(self.reply), "It is 408.", "stop", 0)]

    workers = []
    if not args.instant:
        connect(None, num_cpus=8, object_store_bytes=1 << 30)
        workers = start_generation_workers(str(model), gen, 1)
    try:
        client = Instant() if args.instant else PoolClient("generation")
        runner = HarnessRunner(cfg, {"generation": client}, tok)

        async def direct(i: int) -> None:
            s = SamplingSettings(gen.max_new_tokens, 1.0, 1.0, seed(i))
            await client.call(1, "generate", list(ids), 1, s, min_version=-1)

        async def endpoint(i: int) -> None:
            s = SamplingSettings(gen.max_new_tokens, 1.0, 1.0, i)
            (sample,) = await runner.group(prompt, 1, s, -1)
            assert sample.episode["env_errors"] == 0, sample.episode

        async def timed(fn, width: int) -> float:
            t0 = time.monotonic()
            for k in range(0, n, width):
                await asyncio.gather(*(fn(i) for i in range(k, min(n, k + width))))
            return (time.monotonic() - t0) / n * 1000

        async def run() -> dict:
            await runner.start()
            try:
                await timed(direct, 8)  # warm: the engine's first batches
                await timed(endpoint, 8)  # warm: imports, the first client
                out = {}
                for width in (1, 8):
                    ds, es = [], []
                    for _ in range(args.rounds):  # interleaved: drift hits both alike
                        ds.append(await timed(direct, width))
                        es.append(await timed(endpoint, width))
                    d, e = statistics.median(ds), statistics.median(es)
                    out[f"at_once_{width}"] = {
                        "direct_ms_per_turn": round(d, 2),
                        "endpoint_ms_per_turn": round(e, 2),
                        "overhead_ms_per_turn": round(e - d, 2),
                    }
                return out
            finally:
                await runner.stop()

        out = asyncio.run(run())
    finally:
        if workers:
            stop_workers(workers, drain_timeout_s=5)
            ray.shutdown()
    print(
        json.dumps(
            {
                "cpu": torch.backends.cpu.get_cpu_capability(),
                "pool": "instant" if args.instant else "vllm fp32",
                "rollout": "verifiers SingleTurnEnv" if args.verifiers else "openai harness",
                "turns": n,
                "max_new_tokens": gen.max_new_tokens,
                **out,
            }
        )
    )


if __name__ == "__main__":
    main()
