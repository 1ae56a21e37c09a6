"""Ctrl-C during `async-grpo run` leaves no process behind: no raylet, no engine, no rank."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from _cli import run_command

pytestmark = pytest.mark.integration
MARKERS = (
    "raylet",
    "gcs_server",
    "ray::",
    "EngineCore",
    "async_grpo.cli train",
    "torch.distributed.run",
    "default_worker.py",
    "_child_main",
)


def _ray_like_pids() -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="ignore")
        except OSError:
            continue
        if any(m in cmd for m in MARKERS):
            pids.add(int(entry.name))
    return pids


def test_ctrl_c_stops_everything(tiny_model_dir, tmp_path):
    before = _ray_like_pids()
    proc = subprocess.Popen(
        run_command(
            "quickstart.yaml",
            f"model={tiny_model_dir}",
            f"output_dir={tmp_path}",
            "trainer.max_steps=1000",
            "batcher.questions_per_step=1",
            "batcher.samples_per_question=4",
            "generation.max_new_tokens=16",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 600
        metrics = tmp_path / "training_metrics.jsonl"  # created at start-up, empty
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):  # a step done
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "no training step within 600s"
            time.sleep(2)
        assert _ray_like_pids() - before  # the run did start Ray, engines and ranks
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 130, out[-4000:]
        assert "interrupted: stopping" in out
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 60
    while (left := _ray_like_pids() - before) and time.monotonic() < deadline:
        time.sleep(1)
    names = {
        p: Path(f"/proc/{p}/cmdline").read_bytes()[:120]
        for p in left
        if os.path.exists(f"/proc/{p}")
    }
    assert not names, f"left behind: {names}"
