"""One `async-grpo run` from a bench: a fresh output folder, the wall time, its rows."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from async_grpo.trainer.loop import IDLE_KEYS


def run(config: str, steps: int, out: Path, *overrides: str) -> tuple[float, list[dict]]:
    """Run `config` for `steps` steps into `out` (emptied first: a fresh run, not a
    continuation); returns the wall seconds and every metrics row."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "async_grpo.cli", "run", config]
    cmd += [f"trainer.max_steps={steps}", f"output_dir={out}", *overrides]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / "training_metrics.jsonl").read_text().splitlines()]
    return wall, rows


def idle_summary(train: list[dict]) -> dict:
    """Summed step time, the trainer's idle seconds and their share of it, and the
    generation pool's busy fraction over the run (as the last step reported it)."""
    step_s = sum(r["time/step"] for r in train)
    idle = sum(r.get(k, 0.0) for r in train for k in IDLE_KEYS)
    return {
        "step_s": round(step_s, 1),
        "idle_s": round(idle, 1),
        "idle_fraction": round(idle / step_s, 4),
        "generation_busy_fraction": round(
            train[-1].get("pool/generation/busy_fraction_run", -1), 4
        ),
    }


def mean(rows: list[dict], key: str) -> float:
    """The mean of `key` over the rows that have it (0 when none do), to 4 places."""
    values = [r[key] for r in rows if key in r]
    return round(sum(values) / len(values), 4) if values else 0.0


def steps_to(train: list[dict], target: float, window: int) -> int | None:
    """The first step (counted from 1) whose last `window` steps' mean reward >= target."""
    rewards = [r["reward/mean"] for r in train]
    for i in range(window - 1, len(train)):
        if sum(rewards[i - window + 1 : i + 1]) / window >= target:
            return i + 1
    return None


def time_to(train: list[dict], target: float, window: int) -> float | None:
    """Elapsed seconds at the first step whose last `window` steps' mean reward >= target."""
    step = steps_to(train, target, window)
    return None if step is None else round(train[step - 1]["time/elapsed"], 1)


def thirds(train: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """The first, middle and last thirds of a run's training rows."""
    third = max(1, len(train) // 3)
    return train[:third], train[third:-third], train[-third:]


EXTRA_SETTINGS: list[str] = []  # `--set` values of the bench's command line, for every run


def train_rows(config: str, steps: int, out: Path, setting: str) -> tuple[float, list[dict]]:
    """`run` with evaluation and sample logs off, one `key=value` setting and the bench's
    `--set` settings; returns the wall seconds and the training rows (evaluation rows
    left out)."""
    wall, rows = run(
        config, steps, out, "eval.data=null", "sample_every=0", setting, *EXTRA_SETTINGS
    )
    return wall, [r for r in rows if "loss" in r]


def summary(wall: float, train: list[dict]) -> dict:
    """What every run-level bench reports: steps, wall time, idle and busy shares, and the
    mean reward over the first, middle and last steps with the elapsed time at each end."""
    parts = thirds(train)
    return {
        "steps": len(train),
        "wall_s": round(wall, 1),
        **idle_summary(train),
        "reward_first_middle_last": [mean(part, "reward/mean") for part in parts],
        "elapsed_at_thirds_s": [round(part[-1]["time/elapsed"], 1) for part in parts],
    }


def sweep(
    doc: str,
    flag: str,
    values: str,
    steps: int,
    out: str,
    one_run: Callable[[str, int, Path, str], dict],
) -> None:
    """A bench's command line: --config, --steps, --out, --`flag` (comma-separated
    values, `values` by default) and --set KEY=VALUE (repeatable, applied to every run);
    one run per value into OUT/`flag`-VALUE, each printed as a JSON line naming this CPU's
    kind and the --set settings."""
    from async_grpo.precision import cpu_kind

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--config", default="configs/arithmetic.yaml")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--out", default=out)
    p.add_argument(f"--{flag}", default=values)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    EXTRA_SETTINGS[:] = args.set
    for value in getattr(args, flag).split(","):
        fig = one_run(args.config, args.steps, Path(args.out) / f"{flag}-{value}", value)
        print(json.dumps({"cpu": cpu_kind(), **fig, "settings": args.set}), flush=True)
