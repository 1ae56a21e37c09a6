"""Trainer-side efficiency figures, printed one per line.

    .venv/bin/python bench/trainer_efficiency.py [--tokens 1024] [--metrics RUN/training_metrics.jsonl]

1. packing: tokens per minibatch / budget for the batcher's streamed rounds (goal >= 0.95),
   on the quickstart shapes (Countdown prompts from sample-data, completions 16..128 tokens);
2. trainer step (FSDP2 policy + chunked log-probs + GRPO loss, fwd+bwd) tokens/s vs a bare
   HF forward/backward on the same packed row (goal >= 0.9);
3. trainer idle fraction (time/wait over time/step) of a finished run, with --metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def packing_figure(budget: int = 2048, ranks: int = 1, steps: int = 50) -> tuple[float, float]:
    from async_grpo.batcher.rounds import fill_round
    from async_grpo.core.packing import plan_minibatches
    from async_grpo.data import load_prompts
    from async_grpo.data.tokenize import tokenize_prompts
    from async_grpo.models import resolve_model

    prompts = tokenize_prompts(
        load_prompts("sample-data/countdown.jsonl")[:64], resolve_model("smollm2-135m")
    )
    rng = random.Random(0)
    full_tokens = full_slots = all_tokens = all_slots = 0
    for _ in range(steps):
        buffer: list[int] = []
        for _ in range(4):  # questions_per_step, each a group of 8
            p = len(rng.choice(prompts).input_token_ids)
            buffer += [p + rng.randint(16, 128) for _ in range(8)]
            while (bins := fill_round(buffer, ranks, budget)) is not None:
                taken = {i for b in bins for i in b}
                full_tokens += sum(buffer[i] for i in taken)
                full_slots += ranks * budget
                buffer = [n for i, n in enumerate(buffer) if i not in taken]
        plan = plan_minibatches(buffer, budget, ranks)
        all_tokens += full_tokens + sum(buffer)
        all_slots += full_slots + len(plan[0]) * ranks * budget
    return full_tokens / max(full_slots, 1), all_tokens / all_slots


def trainer_figure(tokens: int) -> tuple[float, float]:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from async_grpo.config import TrainerConfig
    from async_grpo.core.loss import build_loss
    from async_grpo.core.packing import PackInput, pack
    from async_grpo.models import resolve_model
    from async_grpo.trainer.model import build_policy

    model_dir = str(resolve_model("smollm2-135m"))
    torch.set_num_threads(2)
    if not dist.is_initialized():
        store = dist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    g = torch.Generator().manual_seed(0)
    samples, used = [], 0
    while used + 250 <= tokens:
        ids = torch.randint(0, 49152, (250,), generator=g).tolist()
        samples.append(PackInput(ids[:150], ids[150:], 0.5, [-1.0] * 100))
        used += 250
    batch = pack(samples)

    def timed(fn, reps: int = 2) -> float:
        fn()  # warm-up
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return reps * used / (time.perf_counter() - t)

    bare = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def bare_step() -> None:
        logits = bare(
            input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False
        ).logits[0]  # [T, V]
        logp = torch.log_softmax(logits.float(), -1)  # [T, V]
        loss = -(
            logp.gather(-1, batch.labels[0].clamp(min=0)[:, None])[:, 0] * batch.loss_mask
        ).sum()
        loss.backward()
        bare.zero_grad(set_to_none=True)

    bare_rate = timed(bare_step)
    policy = build_policy(model_dir, TrainerConfig(), torch.device("cpu"), 1)
    loss_fn = build_loss(TrainerConfig().loss)

    def our_step() -> None:
        logp, ent = policy(batch, True)
        loss, _ = loss_fn(logp, batch, 1, 1, None, 1)
        loss.backward()
        policy.zero_grad(set_to_none=True)

    return timed(our_step), bare_rate


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def idle_figure(path: str) -> float:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return sum(r.get("time/wait", 0.0) for r in rows) / sum(r["time/step"] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--metrics", default=None)
    args = parser.parse_args()
    full, overall = packing_figure()
    print(
        f"packing: streamed rounds {full:.3f} of the token budget (goal >= 0.95);"
        f" {overall:.3f} including each step's last, partial round",
        flush=True,
    )
    ours, bare = trainer_figure(args.tokens)
    print(
        f"trainer: {ours:.0f} tokens/s vs bare HF forward/backward {bare:.0f} tokens/s:"
        f" {ours / bare:.2f} (goal >= 0.9)",
        flush=True,
    )
    if args.metrics:
        print(
            f"trainer idle (waiting for minibatches): {idle_figure(args.metrics):.1%} of step time",
            flush=True,
        )


if __name__ == "__main__":
    main()
