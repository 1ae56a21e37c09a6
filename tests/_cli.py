"""The argv of `async-grpo run` as the integration tests start it (this interpreter)."""

import socket
import sys
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
