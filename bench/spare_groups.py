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

from pathlib import Path

from _runs import summary, sweep, train_rows


def one_run(config: str, steps: int, out: Path, spares: str) -> dict:
    wall, train = train_rows(config, steps, out, f"batcher.spare_groups={spares}")
    return {
        "spare_groups": int(spares),
        **summary(wall, train),
        "spares_used": sum(r.get("spare_groups_used", 0.0) for r in train),
        "skipped_samples": sum(r.get("skipped_samples", 0.0) for r in train),
        "trained_samples": sum(r.get("samples/trained", 0.0) for r in train),
    }


if __name__ == "__main__":
    sweep(__doc__, "spares", "0,4", 20, "outputs/bench-spare-groups", one_run)
