"""Model rewards: what a slow judge costs the generation pool, and how a small judge agrees
with exact match.

    .venv/bin/python bench/model_rewards.py throughput --groups 48 --judge-delay 2
    .venv/bin/python bench/model_rewards.py agreement --questions 64

`throughput`: one SmolLM2-135M generation worker (fp32 on CPU) makes `--groups` groups of
4 through the batcher's own group code (`batcher.single_turn.single_turn_group`, real pool
clients), `--in-flight` groups at a time as a run with `questions_per_step` 4 and one step
off-policy keeps them; scored once by a rule (`exact`, the verifier pool) and once by a
judge pool alone. The judge is the real judge worker on the tiny random model (its verdicts
get the fallback: this measures time, not verdicts) holding each call `--judge-delay`
seconds before it judges, as a large judge elsewhere would. Prints the generation pool's
tokens/s under each, their ratio, and the judge's calls: items per call and requests in its
engine, sampled every 0.25 s.

`agreement`: SmolLM2-135M answers `--questions` held-out arithmetic prompts (one sample
each, temperature 1), exact match (`last_number`) scores them, and SmolLM2-135M judges the
same answers (`verdict: yes_prob`). Prints the agreement at a P(yes) threshold of 0.5, at
the best threshold, and the AUC of P(yes) against exact match.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from async_grpo.rewards.judge import JudgeWorker

REPO = Path(__file__).resolve().parents[1]
HELD_OUT = REPO / "sample-data" / "arithmetic-heldout.jsonl"


class SlowJudge(JudgeWorker):
    """The judge worker, holding each call `delay_s` before it judges."""

    delay_s = float(os.environ.get("BENCH_JUDGE_DELAY_S", "2.0"))

    async def judge(self, items):
        self.in_flight += len(items)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= len(items)
        return await super().judge(items)


def _prompts(n: int):
    from transformers import AutoTokenizer

    from async_grpo.data import load_prompts
    from async_grpo.data.tokenize import chat_token_ids
    from async_grpo.models import SMOLLM2_NAME, prepare_model

    model = prepare_model(SMOLLM2_NAME)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = load_prompts(HELD_OUT)[:n]
    for p in prompts:
        p.input_token_ids = chat_token_ids(tok, p.input)
    return model, prompts


async def _groups(cfg, clients, prompts, groups, in_flight, counters):
    from async_grpo.batcher.single_turn import single_turn_group
    from async_grpo.inference.types import SamplingSettings

    slots = asyncio.Semaphore(in_flight)
    tokens = 0

    async def one(i):
        nonlocal tokens
        async with slots:
            books, book = defaultdict(float), [0, 0, []]
            sampling = SamplingSettings(cfg.generation.max_new_tokens, 1.0, 1.0, seed=i)
            group = await single_turn_group(
                cfg, clients, books, book, prompts[i % len(prompts)], sampling, 0,
                None, None, counters,
            )  # fmt: skip
            tokens += sum(len(s.completion_ids) for s in group)

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(groups)))
    return tokens / (time.monotonic() - t0)


def _measure(args, scoring, gen, tiny, prompts) -> dict:
    """Tokens/s of the generation pool with groups scored by `scoring` (its pool started
    here, stopped at the end), and the judge's calls."""
    from async_grpo import pools
    from async_grpo.config import JudgeConfig, RunConfig, VerifierConfig
    from async_grpo.inference.client import PoolClient

    if scoring == "rule":
        v = VerifierConfig(rewards=["last_number"])
        started = pools.start_verifier_workers(v, 1)
    else:
        judge = JudgeConfig(model=str(tiny), max_model_len=512, kv_cache_gib=1)
        v = VerifierConfig(rewards=[], judge=judge)
        env = {"BENCH_JUDGE_DELAY_S": str(args.judge_delay)}
        opts = {"num_cpus": 1, "runtime_env": {"env_vars": env}, "max_restarts": 0}
        started = pools._start_pool(
            SlowJudge, "judge", "judge", opts, 1, False, 900.0,
            lambda wid: (str(tiny), judge, wid, "cpu"), None,
        ).wait()  # fmt: skip
    cfg = RunConfig(generation=gen, verifier=v)
    cfg.batcher.samples_per_question = 4
    names = ["generation"] + (["verifier"] if v.rewards else []) + v.models
    clients = {n: PoolClient(n) for n in names}
    counters: dict[str, float] = defaultdict(float)
    depth: list[int] = []

    async def sample():
        while True:
            if v.models:
                depth.append((await started[0].ping.remote())["in_flight"])
            await asyncio.sleep(0.25)

    async def run():
        sampler = asyncio.get_running_loop().create_task(sample())
        try:
            await _groups(cfg, clients, prompts, 4, args.in_flight, counters)  # warm-up
            return await _groups(cfg, clients, prompts, args.groups, args.in_flight, counters)
        finally:
            sampler.cancel()

    try:
        out = {f"tokens_per_s_{scoring}": round(asyncio.run(run()), 1)}
    finally:
        pools.stop_workers(started, drain_timeout_s=5)
    if v.models:
        out |= {
            "judge_calls": counters["judge/scored"] / 4,
            "judge_items_per_call": 4,
            "judge_in_flight_mean": round(sum(depth) / max(1, len(depth)), 2),
            "judge_in_flight_max": max(depth, default=0),
            "judge_timeouts": counters["judge/timeout"],
        }
    return out


def throughput(args) -> dict:
    import ray

    from async_grpo import pools
    from async_grpo.config import GenerationConfig
    from async_grpo.models import make_tiny_model
    from async_grpo.ray_utils import connect

    model, prompts = _prompts(64)
    tiny = make_tiny_model(Path(args.work) / "tiny", tokenizer_from=model)
    connect(None, num_cpus=8, object_store_bytes=512 << 20)
    gen = GenerationConfig(max_model_len=512, max_new_tokens=args.max_new_tokens, kv_cache_gib=1)
    workers = pools.start_generation_workers(str(model), gen, 1)
    out: dict = {}
    try:
        for scoring in ("rule", "judge"):
            out |= _measure(args, scoring, gen, tiny, prompts)
    finally:
        pools.stop_workers(workers, drain_timeout_s=5)
        ray.shutdown()
    out["ratio"] = round(out["tokens_per_s_judge"] / out["tokens_per_s_rule"], 3)
    return out


def agreement(args) -> dict:
    from async_grpo.config import GenerationConfig, JudgeConfig
    from async_grpo.inference.engine_args import vllm_env
    from async_grpo.inference.generation import GenerationWorker
    from async_grpo.inference.types import SamplingSettings
    from async_grpo.rewards import RewardInput, get_reward
    from async_grpo.rewards.judge import engine_config

    model, prompts = _prompts(args.questions)
    gen = GenerationConfig(max_model_len=512, max_new_tokens=args.max_new_tokens, kv_cache_gib=1)
    os.environ.update(vllm_env(gen, "cpu"))
    judge_cfg = JudgeConfig(model=str(model), max_model_len=768, kv_cache_gib=1)
    os.environ.update(vllm_env(engine_config(judge_cfg), "cpu"))
    rule = get_reward("last_number")

    async def go():
        g = GenerationWorker(str(model), gen, "gen-bench")
        await g.start(register=False)
        s = SamplingSettings(args.max_new_tokens, 1.0, 1.0, seed=0)
        outs = await asyncio.gather(*(g.generate(p.input_token_ids, 1, s) for p in prompts))
        await g.stop(1)
        texts = [o[0].text for o in outs]
        exact = [
            rule(RewardInput(p.input, t, p.answer)).reward >= 1.0
            for p, t in zip(prompts, texts, strict=True)
        ]
        j = JudgeWorker(str(model), judge_cfg, "judge-bench")
        await j.start(register=False)
        t0 = time.monotonic()
        verdicts = await j.judge(
            [(p.input, p.answer, t) for p, t in zip(prompts, texts, strict=True)]
        )
        seconds = time.monotonic() - t0
        await j.stop(1)
        return exact, verdicts, seconds

    exact, verdicts, seconds = asyncio.run(go())
    p_yes = [v if v is not None else 0.0 for v, _ in verdicts]
    agree = lambda t: sum((p >= t) == e for p, e in zip(p_yes, exact, strict=True)) / len(exact)  # noqa: E731
    best = max([*sorted(set(p_yes)), 1.01], key=agree)  # 1.01: every answer judged wrong
    pos = [p for p, e in zip(p_yes, exact, strict=True) if e]
    neg = [p for p, e in zip(p_yes, exact, strict=True) if not e]
    pairs = [(a > b) + 0.5 * (a == b) for a in pos for b in neg]
    return {
        "questions": len(exact),
        "exact_match_rate": round(sum(exact) / len(exact), 3),
        "unparsed": sum(v is None for v, _ in verdicts),
        "p_yes_mean_right": round(sum(pos) / max(1, len(pos)), 3),
        "p_yes_mean_wrong": round(sum(neg) / max(1, len(neg)), 3),
        "agreement_at_0.5": round(agree(0.5), 3),
        "agreement_best": round(agree(best), 3),
        "best_threshold": round(best, 3),
        "auc": round(sum(pairs) / len(pairs), 3) if pairs else None,
        "judge_ms_per_answer": round(1000 * seconds / len(exact), 1),
    }


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("throughput", "agreement"))
    p.add_argument("--groups", type=int, default=48)
    p.add_argument("--in-flight", type=int, default=8)
    p.add_argument("--judge-delay", type=float, default=2.0)
    p.add_argument("--questions", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--work", default="/tmp/bench-model-rewards")
    args = p.parse_args()
    result = throughput(args) if args.what == "throughput" else agreement(args)
    cpu = torch.backends.cpu.get_cpu_capability()
    print(json.dumps({"bench": f"model_rewards {args.what}", "cpu": cpu, **result}))


if __name__ == "__main__":
    main()
