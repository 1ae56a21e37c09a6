"""Step-0 success of a multi-turn task: how the untrained model does on an environment,
through the real pools (a vLLM generation worker, an environment worker, the batcher's
episode driver). Used to choose prompts and task sizes so that GRPO groups hold a reward
to learn from.

    .venv/bin/python bench/env_step0.py configs/calculator.yaml --questions 32

Prints one JSON line: the CPU kind, the dtype, the mean episode reward, the share of
episodes with a tool call (when the environment reports `tool_calls`), mean turns, and
the share of groups with mixed rewards (the ones GRPO learns from).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--questions", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=0, help="print this many episodes' text first")
    args = p.parse_args()

    import ray
    import torch
    from transformers import AutoTokenizer

    from async_grpo.batcher.episodes import EpisodeRunner
    from async_grpo.data import PromptSampler
    from async_grpo.data.tokenize import prepare_prompts
    from async_grpo.environments.turns import TurnFormat
    from async_grpo.inference.client import PoolClient
    from async_grpo.inference.types import SamplingSettings
    from async_grpo.models import resolve_model
    from async_grpo.pools import (
        start_environment_workers,
        start_generation_workers,
        stop_workers,
    )
    from async_grpo.precision import resolve_dtype
    from async_grpo.preflight.settings import load_config
    from async_grpo.ray_utils import connect

    cfg = load_config(args.config, args.overrides)
    model = resolve_model(cfg.model)
    prompts = prepare_prompts(cfg.data, model, cfg.generation.max_model_len)
    sampler = PromptSampler(len(prompts), args.seed)
    chosen = [prompts[sampler.index_at(i)] for i in range(args.questions)]
    turns = TurnFormat(AutoTokenizer.from_pretrained(model), cfg.environment.max_observation_tokens)
    connect(None, num_cpus=8, object_store_bytes=1 << 30)
    workers = start_generation_workers(str(model), cfg.generation, 1)
    workers += start_environment_workers(cfg.environment, 1)
    try:
        clients = {pool: PoolClient(pool) for pool in ("generation", "environment")}
        runner = EpisodeRunner(cfg, clients, turns)
        g, n = cfg.generation, cfg.batcher.samples_per_question

        async def run() -> list:
            return await asyncio.gather(
                *(
                    runner.group(p, n, SamplingSettings(g.max_new_tokens, g.temperature, 1.0, i), 0)
                    for i, p in enumerate(chosen)
                )
            )

        t0 = time.monotonic()
        groups = asyncio.run(run())
        wall = time.monotonic() - t0
    finally:
        stop_workers(workers, drain_timeout_s=5)
        ray.shutdown()
    episodes = [s for grp in groups for s in grp]
    for s in episodes[: args.show]:
        print(f"--- reward {s.reward}: {turns.tokenizer.decode(s.completion_ids)!r}", flush=True)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(
        json.dumps(
            {
                "cpu": torch.backends.cpu.get_cpu_capability(),
                "dtype": resolve_dtype(cfg.generation.dtype, "cpu").dtype,
                "data": cfg.data,
                "environment": cfg.environment.name,
                "episodes": len(episodes),
                "reward_mean": round(mean([s.reward for s in episodes]), 4),
                "success": round(mean([float(s.reward >= 1.0) for s in episodes]), 4),
                "tool_call_episodes": round(
                    mean([float(s.episode.get("info/tool_calls", 0) > 0) for s in episodes]), 4
                ),
                "turns_mean": round(mean([s.episode["turns"] for s in episodes]), 3),
                "tokens_mean": round(mean([len(s.completion_ids) for s in episodes]), 1),
                "mixed_groups": round(
                    mean([float(len({s.reward for s in grp}) > 1) for grp in groups]), 4
                ),
                "env_errors": sum(s.episode["env_errors"] for s in episodes),
                "wall_s": round(wall, 1),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
