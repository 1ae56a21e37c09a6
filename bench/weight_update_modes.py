"""How a push meets running requests: the same run with `generation.weight_update` `wait`
(running requests finish on the old weights; the fixed lag) and `in_flight` (they are
frozen, re-prefilled under the new weights and continued).

    .venv/bin/python bench/weight_update_modes.py [--config configs/arithmetic.yaml] [--steps 20]

Runs `async-grpo run CONFIG` once per mode on this machine (evaluation and sample logs
off) and prints one JSON line per run, naming this CPU's kind: wall time, the trainer's
idle share of the summed step time (`time/wait` + `time/wait_generated`), push seconds
and the pause inside them, per-sample and per-token staleness, the share of samples whose
tokens came from two versions, and the mean reward over the first, middle and last steps.
"""

from __future__ import annotations

from pathlib import Path

from _runs import mean, summary, sweep, train_rows


def one_run(config: str, steps: int, out: Path, mode: str) -> dict:
    wall, train = train_rows(config, steps, out, f"generation.weight_update={mode}")
    return {
        "weight_update": mode,
        **summary(wall, train),
        "push_s": round(sum(r.get("time/weight_push", 0.0) for r in train), 1),
        "pause_s": round(sum(r.get("time/weight_drain", 0.0) for r in train), 1),
        "staleness_mean": mean(train, "staleness/mean"),
        "staleness_token_mean": mean(train, "staleness/token_mean"),
        "mixed_version_samples": mean(train, "samples/mixed_versions"),
    }


if __name__ == "__main__":
    sweep(__doc__, "modes", "wait,in_flight", 20, "outputs/bench-weight-update", one_run)
