"""Verifier throughput: samples scored per second for countdown and math.

Prints, for each reward:
- in-process: the bare reward function in this process (no isolation; the ceiling);
- sandbox: one VerifierWorker without Ray (`--concurrency` subprocesses);
- ray pool: VerifierPool of `--workers` actors on a private local Ray instance;
- process per sample: a fresh scoring subprocess per sample (the design not taken).
The sandbox's overhead per sample is (1/sandbox - 1/in-process) at concurrency 1.

    OMP_NUM_THREADS=1 .venv/bin/python bench/verifier_throughput.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Callable

from async_grpo.config import VerifierConfig
from async_grpo.rewards import RewardInput, get_reward
from async_grpo.rewards.pool import VerifierPool, VerifierWorker
from async_grpo.rewards.sandbox import SandboxPool


def countdown_samples(n: int) -> list[RewardInput]:
    """Half right, half wrong, each a 4-number equation inside <think>/<answer>."""
    out = []
    for i in range(n):
        a, b, c, d = i % 50 + 1, i % 7 + 1, i % 11 + 2, i % 5 + 3
        equation = f"({a} + {b}) * {c} - {d}" if i % 2 == 0 else f"{a} * {b} + {c} / {d}"
        target = (a + b) * c - d
        completion = f"<think>try things</think>\n<answer>{equation}</answer>"
        out.append(RewardInput("p", completion, {"target": target, "numbers": [a, b, c, d]}))
    return out


def math_samples(n: int) -> list[RewardInput]:
    """Fractions in several spellings, against decimal or LaTeX ground truths."""
    out = []
    for i in range(n):
        p, q = i % 9 + 1, 2 ** (i % 3 + 1)
        spelled = [rf"\frac{{{p}}}{{{q}}}", f"{p}/{q}", f"{p / q}", rf"\frac{{{p + 1}}}{{{q}}}"]
        completion = f"Working... so the answer is \\boxed{{{spelled[i % 4]}}}."
        gold = f"{p / q}" if i % 2 else rf"\dfrac{{{p}}}{{{q}}}"
        out.append(RewardInput("p", completion, gold))
    return out


def rate(n: int, run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return n / (time.perf_counter() - start)


def bench_reward(name: str, samples: list[RewardInput], args: argparse.Namespace) -> None:
    fn = get_reward(name)
    fn(samples[0])  # warm caches (math-verify builds its parsers lazily)
    inproc = rate(len(samples), lambda: [fn(s) for s in samples])
    cfg = VerifierConfig(rewards=[name], timeout_s=10.0, max_concurrency=1)
    worker = VerifierWorker(cfg)
    asyncio.run(worker.score(samples[:20]))
    serial = rate(len(samples), lambda: [worker._sandbox.score(s) for s in samples])
    worker.close()
    cfg.max_concurrency = args.concurrency
    worker = VerifierWorker(cfg)
    asyncio.run(worker.score(samples[:20]))
    sandboxed = rate(len(samples), lambda: asyncio.run(worker.score(samples)))
    worker.close()
    few = samples[: args.fresh]
    fresh = rate(len(few), lambda: [_fresh_process(fn, s) for s in few])
    overhead_ms = 1000 * (1 / serial - 1 / inproc)
    print(f"{name} in-process: {inproc:.0f} samples/s")
    print(f"{name} sandbox x1: {serial:.0f} samples/s (overhead {overhead_ms:.2f} ms/sample)")
    print(f"{name} sandbox x{args.concurrency}: {sandboxed:.0f} samples/s")
    print(f"{name} process per sample: {fresh:.1f} samples/s")
    if not args.no_ray:
        cfg.num_workers = args.workers
        pool = VerifierPool.start(cfg, num_cpus=0)
        asyncio.run(pool.score(samples[:40]))
        pooled = rate(len(samples), lambda: asyncio.run(pool.score(samples)))
        assert pool.stats()["verifier/errors"] == 0
        pool.shutdown()
        print(f"{name}: {pooled:.0f} samples/s (ray pool, {args.workers} x {args.concurrency})")


def _fresh_process(fn: Callable, sample: RewardInput) -> None:
    pool = SandboxPool(fn, num_procs=1, timeout_s=10.0)
    pool.score(sample)
    pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2, help="Ray actors")
    parser.add_argument("--concurrency", type=int, default=2, help="subprocesses per worker")
    parser.add_argument("--fresh", type=int, default=5, help="samples for process-per-sample")
    parser.add_argument("--no-ray", action="store_true")
    args = parser.parse_args()
    print(f"cores: {os.cpu_count()}, samples: {args.samples}")
    if not args.no_ray:
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=200 * 1024**2,
            log_to_driver=False,
        )
    bench_reward("countdown", countdown_samples(args.samples), args)
    bench_reward("math", math_samples(args.samples // 4), args)


if __name__ == "__main__":
    main()
