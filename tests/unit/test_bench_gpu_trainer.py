"""bench/gpu_trainer.py runs the trainer's path end to end (here on CPU, tiny shapes) and
prints one JSON figure per line; backends that cannot train here say so instead."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_trainer.py"


def test_bench_prints_a_figure_per_combination():
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--models", "tiny", "--rows", "1024"]
    cmd += ["--attention", "sdpa,flex", "--steps", "1", "--warmup", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    figs = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [(f["attention"], f["shared_prompts"]) for f in figs] == [
        ("sdpa", False),
        ("sdpa", True),
        ("flex", False),
        ("flex", True),
    ]
    unshared, shared = figs[0], figs[1]
    assert unshared["tok_per_s"] > 0 and unshared["samples"] >= 1
    assert shared["row_tokens"] <= 1024 and shared["samples"] >= unshared["samples"]
    assert shared["device"].startswith("cpu ") and unshared["mfu"] is None
    assert all("cannot train on CPU" in f["skipped"] for f in figs[2:])
