"""Spare groups against none: the same run with `batcher.spare_groups` at each value given.

    .venv/bin/python bench/spare_groups.py [--config configs/arithmetic.yaml] [--steps 20]
                                           [--spares 0,4]

Runs `async-grpo run CONFIG` once per value on this machine (evaluation and sample logs
off) and prints one JSON line per run, naming this CPU's kind: wall time, the trainer's idle
share and the generation pool's busy share, how many groups the spares replaced, the
samples that carried a gradient, and the mean reward over the first, middle and last steps
with the wall time at which each third ended.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _runs import idle_summary, mean, run, thirds


def one_run(config: str, steps: int, out: Path, spares: int) -> dict:
    off = ["eval.data=null", "sample_every=0", f"batcher.spare_groups={spares}"]
    wall, rows = run(config, steps, out, *off)
    train = [r for r in rows if "loss" in r]
    parts = thirds(train)
    return {
        "spare_groups": spares,
        "steps": len(train),
        "wall_s": round(wall, 1),
        **idle_summary(train),
        "spares_used": sum(r.get("spare_groups_used", 0.0) for r in train),
        "skipped_samples": sum(r.get("skipped_samples", 0.0) for r in train),
        "trained_samples": sum(r.get("samples/trained", 0.0) for r in train),
        "reward_first_middle_last": [mean(part, "reward/mean") for part in parts],
        "elapsed_at_thirds_s": [round(part[-1]["time/elapsed"], 1) for part in parts],
    }


def main() -> None:
    from async_grpo.precision import cpu_kind

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/arithmetic.yaml")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="outputs/bench-spare-groups")
    p.add_argument("--spares", default="0,4")
    args = p.parse_args()
    for spares in (int(x) for x in args.spares.split(",")):
        fig = one_run(args.config, args.steps, Path(args.out) / f"spares{spares}", spares)
        print(json.dumps({"cpu": cpu_kind(), **fig}), flush=True)


if __name__ == "__main__":
    main()
