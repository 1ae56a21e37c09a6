"""Objectives, off-policy corrections and updates per batch on the arithmetic curve,
several seeds each.

    python bench/objectives.py --settings behaviour,current --seeds 0,1,2
    python bench/objectives.py --table            # the table of every run recorded so far

Each run is `async-grpo run configs/arithmetic.yaml` for 40 steps with `batcher.seed` set
(prompt order and sampling seeds) and the held-out evaluation once, at the end. One JSON line
per run goes to --results (a run already there is not run again), naming the CPU's kind;
the table gives per setting the mean over seeds and each seed's figures: time to reward
0.8 (the elapsed time at the first step whose last 4 steps average 0.8 or more), reward
over steps 31-40, held-out greedy accuracy at version 40, the clipped and masked shares
of tokens, and the wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

from _runs import mean, run, steps_to, time_to

SETTINGS: dict[str, list[str]] = {  # name -> overrides of the config
    "behaviour": ["trainer.loss.proximal=behaviour"],
    "current": ["trainer.loss.proximal=current"],
    "current-seqmask": [  # TRL's default: sequence-level mask at 3
        "trainer.loss.proximal=current",
        "trainer.loss.correction.level=sequence",
        "trainer.loss.correction.mode=mask",
        "trainer.loss.correction.cap=3.0",
    ],
    "gspo": ["trainer.loss.proximal=behaviour", "trainer.loss.objective=gspo"],
    "cispo": [  # TRL's cap (ScaleRL)
        "trainer.loss.proximal=behaviour",
        "trainer.loss.objective=cispo",
        "trainer.loss.cispo_cap=5.0",
    ],
    "cispo-1.2": [  # verl's example cap
        "trainer.loss.proximal=behaviour",
        "trainer.loss.objective=cispo",
        "trainer.loss.cispo_cap=1.2",
    ],
    "gmpo": ["trainer.loss.proximal=behaviour", "trainer.loss.objective=gmpo"],
    "sapo": ["trainer.loss.proximal=behaviour", "trainer.loss.objective=sapo"],
    # several optimizer updates per batch (the ratio against the batch's first policy)
    "m2": ["trainer.mini_batches=2"],
    "m4": ["trainer.mini_batches=4"],
    "e2": ["trainer.epochs=2"],
    "dapo": [],  # configs/dapo-arithmetic.yaml as it is (CONFIGS)
}
CONFIGS = {"dapo": "configs/dapo-arithmetic.yaml"}  # settings with a config of their own
EVAL_AT_END = ["eval.every=40", "eval.at_start=false", "sample_every=0"]


def one_run(config: str, setting: str, seed: int, steps: int, out: Path) -> dict:
    """Run `setting` with `seed`; its figures."""
    from async_grpo.precision import cpu_kind

    overrides = [*SETTINGS[setting], f"batcher.seed={seed}", *EVAL_AT_END]
    config = CONFIGS.get(setting, config)
    wall, rows = run(config, steps, out / f"{setting}-seed{seed}", *overrides)
    train = [r for r in rows if "loss" in r]
    heldout = [r for r in rows if "eval/pass_at_1" in r]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True)
    return {
        "setting": setting,
        "seed": seed,
        "cpu": cpu_kind(),
        "commit": commit.stdout.decode().strip(),
        "steps": len(train),
        "wall_s": round(wall, 1),
        "time_to_0.8_s": time_to(train, 0.8, window=4),
        "steps_to_0.8": steps_to(train, 0.8, window=4),
        "reward_1_2": mean(train[:2], "reward/mean"),
        "reward_9_12": mean(train[8:12], "reward/mean"),
        "reward_31_40": mean(train[30:40], "reward/mean"),
        "heldout_40": round(heldout[-1]["eval/pass_at_1"], 4) if heldout else None,
        "clip_frac": mean(train, "clip_fraction"),
        "masked_frac": round(
            mean(train, "is_masked_frac") + mean(train, "negative_masked_frac"), 4
        ),
        "truncated_frac": mean(train, "is_truncated_frac"),
        "is_weight_mean": mean(train, "is_weight_mean"),
        "is_weight_max": max((r.get("is_weight_max", 0.0) for r in train), default=0.0),
    }


def table(results: list[dict]) -> str:
    """A Markdown table: one row per setting (mean over its seeds), the seeds' values in
    brackets."""
    cols = [
        "time_to_0.8_s",
        "steps_to_0.8",
        "reward_31_40",
        "heldout_40",
        "clip_frac",
        "masked_frac",
        "wall_s",
    ]
    lines = [
        "| setting | CPU | seeds | " + " | ".join(cols) + " |",
        "|---" * (len(cols) + 3) + "|",
    ]
    for setting, cpu in dict.fromkeys((r["setting"], r["cpu"]) for r in results):
        runs = [r for r in results if (r["setting"], r["cpu"]) == (setting, cpu)]
        cells = []
        for c in cols:
            values = [r.get(c) for r in runs]
            known = [v for v in values if v is not None]
            avg = f"{statistics.mean(known):.4g}" if known else "-"
            each = ", ".join("-" if v is None else f"{v:.4g}" for v in values)
            cells.append(f"{avg} ({each})" if len(values) > 1 else avg)
        seeds = ",".join(str(r["seed"]) for r in runs)
        lines.append(f"| {setting} | {cpu} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/arithmetic.yaml")
    p.add_argument("--settings", default="behaviour,current")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default="outputs/bench-objectives")
    p.add_argument("--results", default="docs/loss-runs/runs.jsonl")
    p.add_argument("--table", action="store_true", help="print the table and run nothing")
    args = p.parse_args()
    path = Path(args.results)
    results = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    if not args.table:
        from async_grpo.precision import cpu_kind

        done = {(r["setting"], r["seed"]) for r in results if r["cpu"] == cpu_kind()}
        for seed in [int(s) for s in args.seeds.split(",")]:
            for setting in args.settings.split(","):
                if (setting, seed) in done:
                    continue
                fig = one_run(args.config, setting, seed, args.steps, Path(args.out))
                print(json.dumps(fig), flush=True)
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a") as f:
                    f.write(json.dumps(fig) + "\n")
                results.append(fig)
    print(table(results))


if __name__ == "__main__":
    main()
