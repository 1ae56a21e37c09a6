"""One `async-grpo run` from a bench: a fresh output folder, the wall time, its rows."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
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


def thirds(train: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """The first, middle and last thirds of a run's training rows."""
    third = max(1, len(train) // 3)
    return train[:third], train[third:-third], train[-third:]
