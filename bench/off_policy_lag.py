"""How far generation may run ahead: the same run at each `batcher.max_off_policy_steps`.

    .venv/bin/python bench/off_policy_lag.py [--config configs/arithmetic.yaml] [--steps 12]
                                             [--lags 1,2] [--set KEY=VALUE ...]
    .venv/bin/python bench/off_policy_lag.py --steps 8 --lags 0 --set generation.threads=2

Runs `async-grpo run CONFIG` once per lag on this machine (evaluation and sample logs off)
and prints one JSON line per run, naming this CPU's kind: wall time, the trainer's idle
share and the generation pool's busy share (the two figures of the deeper-asynchrony
goals), the samples' mean staleness in steps, and the mean reward over the first, middle
and last steps with the wall time at which each third ended. A lag of 0 makes generation
and training take turns (the second line: the engine then gets both cores).
"""

from __future__ import annotations

from pathlib import Path

from _runs import mean, summary, sweep, train_rows


def one_run(config: str, steps: int, out: Path, lag: str) -> dict:
    wall, train = train_rows(config, steps, out, f"batcher.max_off_policy_steps={lag}")
    return {
        "max_off_policy_steps": int(lag),
        **summary(wall, train),
        "staleness_mean": mean(train, "staleness/mean"),
    }


if __name__ == "__main__":
    sweep(__doc__, "lags", "1,2", 12, "outputs/bench-off-policy-lag", one_run)
