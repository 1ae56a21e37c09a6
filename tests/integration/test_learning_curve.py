"""The CPU learning signal: SmolLM2-135M on one-step arithmetic, reward rises (`pytest -m slow`).

A shorter run of the run behind docs/learning-curve.md (12 of its 40 steps, ~5 minutes)."""

import json
import subprocess
from pathlib import Path

import pytest
from _cli import run_command

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
STEPS = 12


def test_reward_rises_on_arithmetic(smollm2_dir, tmp_path):
    cmd = run_command(
        "arithmetic.yaml",
        f"output_dir={tmp_path}",
        f"trainer.max_steps={STEPS}",
    )
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    metrics = [json.loads(line) for line in (tmp_path / "training_metrics.jsonl").open()]
    rewards = [m["reward/mean"] for m in metrics]
    assert len(rewards) == STEPS
    start, end = sum(rewards[:2]) / 2, sum(rewards[-4:]) / 4
    # about +0.3 is seen over these 12 steps (docs/learning-curve.md): require most of it
    assert end >= start + 0.2, f"reward did not rise: {[round(x, 3) for x in rewards]}"
    lengths = [m["output_length/mean"] for m in metrics]
    assert sum(lengths[-4:]) / 4 < sum(lengths[:2]) / 2, lengths  # answers get shorter
