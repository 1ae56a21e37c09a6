"""Helpers of the tests that start the CLI: its argv, a free port, its output lines."""

import os
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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
    path = f"{REPO / 'tests' / 'integration' / 'plugins'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return {**os.environ, "PYTHONPATH": path}
