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

import argparse
import json
from pathlib import Path

from _runs import idle_summary, mean, run, thirds


def one_run(config: str, steps: int, out: Path, mode: str) -> dict:
    off = ["eval.data=null", "sample_every=0", f"generation.weight_update={mode}"]
    wall, rows = run(config, steps, out, *off)
    train = [r for r in rows if "loss" in r]
    return {
        "weight_update": mode,
        "steps": len(train),
        "wall_s": round(wall, 1),
        **idle_summary(train),
        "push_s": round(sum(r.get("time/weight_push", 0.0) for r in train), 1),
        "pause_s": round(sum(r.get("time/weight_drain", 0.0) for r in train), 1),
        "staleness_mean": mean(train, "staleness/mean"),
        "staleness_token_mean": mean(train, "staleness/token_mean"),
        "mixed_version_samples": mean(train, "samples/mixed_versions"),
        "reward_first_middle_last": [mean(part, "reward/mean") for part in thirds(train)],
    }


def main() -> None:
    from async_grpo.precision import cpu_kind

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/arithmetic.yaml")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="outputs/bench-weight-update")
    p.add_argument("--modes", default="wait,in_flight")
    args = p.parse_args()
    for mode in args.modes.split(","):
        fig = one_run(args.config, args.steps, Path(args.out) / mode, mode)
        print(json.dumps({"cpu": cpu_kind(), **fig}), flush=True)


if __name__ == "__main__":
    main()
