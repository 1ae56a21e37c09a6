"""Helpers of the tests that start the CLI: its argv, a free port, its output lines."""

import os
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLUGINS = REPO / "tests" / "integration" / "plugins"  # test rewards, environments, hooks
CLI = [sys.executable, "-m", "async_grpo.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_command(config: str, *overrides: str) -> list[str]:
    """`python -m async_grpo.cli run configs/<config> <overrides...>`."""
    return [
        sys.executable,
        "-m",
        "async_grpo.cli",
        "run",
        str(REPO / "configs" / config),
        *overrides,
    ]


def wait_for_line(proc, text, timeout_s=180):
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline and proc.poll() is None:
        seen.append(proc.stdout.readline())
        if text in seen[-1]:
            return
    raise AssertionError(f"no line {text!r} from the worker command: {''.join(seen)[-3000:]}")


def plugin_env() -> dict[str, str]:
    """This environment with the test reward plugins (tests/integration/plugins) importable."""
    path = f"{PLUGINS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return {**os.environ, "PYTHONPATH": path}


def loop_command(model_dir: Path, out: Path, steps: int, *extra: str) -> list[str]:
    """The whole-loop run of the integration and fault tests: 2 gloo ranks, KL on (a
    log-prob worker), one group of 6 a step, on-policy, checkpoints every 3 steps, a
    reward with variance even for a tiny random model (`extra` overrides any of it)."""
    return run_command(
        "quickstart.yaml",
        f"model={model_dir}",
        f"output_dir={out}",
        f"trainer.max_steps={steps}",
        "trainer.num_ranks=2",
        "trainer.lr=1e-3",
        "trainer.loss.kl_coef=0.01",
        "batcher.questions_per_step=1",
        "batcher.samples_per_question=6",
        "batcher.max_off_policy_steps=0",
        "batcher.max_tokens_per_gpu=512",
        "generation.max_model_len=512",
        "generation.max_new_tokens=24",
        "generation.dtype=float32",
        "trainer.save_every=3",
        "verifier.rewards=[rewards_for_tests:vowel_share]",
        *extra,
    )


def run_loop(model_dir: Path, out: Path, steps: int, *extra: str) -> list[dict]:
    """`loop_command` run to its end (exit 0 asserted); its console kept in
    out/console.txt; returns its metrics rows."""
    import json
    import subprocess

    cmd = loop_command(model_dir, out, steps, *extra)
    r = subprocess.run(cmd, env=plugin_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    (out / "console.txt").write_text(r.stdout + r.stderr)
    return [json.loads(line) for line in (out / "training_metrics.jsonl").read_text().splitlines()]


# `loop_command` overrides for a run one step off-policy: 2 groups a step, one at a time in
# the engine (its batch stays the same from run to run), drawn by a curriculum
ASYNC = (
    "batcher.questions_per_step=2",
    "batcher.max_off_policy_steps=1",
    "generation.max_concurrent_seqs=6",
    "batcher.curriculum=true",
)
