"""Where the output of Ray actors goes when a run is quiet: one file per actor.

`async-grpo run` (without --verbose) gives each actor it starts the environment variable
ASYNC_GRPO_LOG_FILE=OUTPUT_DIR/logs/NAME.log (`actor_runtime_env`); the actor's constructor
calls `to_file`, which points the process's stdout and stderr (file descriptors 1 and 2,
so also those of its children, e.g. vLLM's engine core) at that file. The console keeps
the start-up lines, the progress bar and the project's own errors.

Ray itself prints one more kind of line in every driver, whatever `log_to_driver` says: the
errors its raylet pushes to a job ("(raylet) A worker died or was killed ..."), from a
thread of its own. A quiet driver sends them to OUTPUT_DIR/logs/ray.log instead
(`ray_errors_to_file`): a worker's death is said by the run's own lines (the replacement,
or the cause the run stops with: async_grpo/cause.py).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

LOG_FILE_ENV = "ASYNC_GRPO_LOG_FILE"


def log_dir(output_dir: str) -> Path:
    return Path(output_dir) / "logs"


def to_file() -> None:
    """Send this process's fds 1 and 2 to $ASYNC_GRPO_LOG_FILE (appended); a no-op when
    it is unset (a verbose run, or an actor started by `async-grpo worker`)."""
    path = os.environ.get(LOG_FILE_ENV)
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def actor_runtime_env(
    runtime_env: dict[str, Any] | None, logs: Path | None, name: str
) -> dict[str, Any]:
    """`runtime_env` plus, when `logs` is set, the variable that sends this actor's output
    to `logs/NAME.log` (else the output streams to the driver), and the run's id where this
    process has one (the actor's files in /dev/shm go in the run's folder: shm_files.py)."""
    from async_grpo.shm_files import RUN_ID_ENV

    env = dict(runtime_env or {})
    extra = {RUN_ID_ENV: os.environ[RUN_ID_ENV]} if os.environ.get(RUN_ID_ENV) else {}
    if logs is not None:
        extra[LOG_FILE_ENV] = str(logs / f"{name}.log")
    if extra:
        env["env_vars"] = {**env.get("env_vars", {}), **extra}
    return env


def quiet_libraries() -> None:
    """In a quiet process: no transformers progress bars or info lines."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def ray_errors_to_file(path: Path) -> None:
    """In a quiet driver: the error lines Ray's raylet pushes to this process's job are
    appended to `path`, with the time, instead of printed. (Ray's listener thread looks up
    `print_to_stdstream` in its module at each message; other output passes through.)"""
    from ray._private import worker

    printed = worker.print_to_stdstream
    original = getattr(printed, "original", printed)

    def to_file(data: dict[str, Any], ignore_prefix: bool) -> None:
        if data.get("pid") != "raylet":
            original(data, ignore_prefix)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with path.open("a") as f:
            f.writelines(f"{stamp} (raylet) {line}\n" for line in data.get("lines", []))

    to_file.original = original  # type: ignore[attr-defined]
    worker.print_to_stdstream = to_file
