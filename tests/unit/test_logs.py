"""Quiet runs: an actor's environment names its log file, and `to_file` sends the
process's stdout and stderr there, those of its children included (vLLM's engine core)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from async_grpo.logs import LOG_FILE_ENV, actor_runtime_env, ray_errors_to_file
from async_grpo.shm_files import RUN_ID_ENV


def test_runtime_env_names_the_log_file_only_when_quiet(tmp_path, monkeypatch):
    monkeypatch.delenv(RUN_ID_ENV, raising=False)
    base = {"env_vars": {"OMP_NUM_THREADS": "1"}}
    assert actor_runtime_env(base, None, "gen-1") == base  # verbose: unchanged
    env = actor_runtime_env(base, tmp_path / "logs", "gen-1")
    assert env["env_vars"] == {
        "OMP_NUM_THREADS": "1",
        LOG_FILE_ENV: str(tmp_path / "logs/gen-1.log"),
    }
    assert base == {"env_vars": {"OMP_NUM_THREADS": "1"}}  # the caller's dict is not changed
    monkeypatch.setenv(RUN_ID_ENV, "r1")  # in a run: its files in /dev/shm go in its folder
    assert actor_runtime_env(None, None, "gen-1") == {"env_vars": {RUN_ID_ENV: "r1"}}


def test_rays_worker_death_lines_go_to_the_log_file(tmp_path, monkeypatch, capsys):
    """Ray prints the raylet's errors in every driver whatever `log_to_driver` says; a quiet
    driver keeps them in logs/ray.log. (Off the console in a whole run with dying workers:
    faults/test_environment_faults.py.)"""
    from ray._private import worker

    monkeypatch.setattr(worker, "print_to_stdstream", worker.print_to_stdstream)  # restored
    ray_errors_to_file(tmp_path / "ray.log")
    ray_errors_to_file(tmp_path / "ray.log")  # twice: still one copy of each line
    death = "A worker died or was killed while executing a task by an unexpected system error."
    worker.print_to_stdstream({"lines": [death], "pid": "raylet", "is_err": False}, False)
    worker.print_to_stdstream({"lines": ["an actor's line"], "pid": 7, "is_err": False}, True)
    out = capsys.readouterr().out
    assert "(raylet)" not in out and "an actor's line" in out
    assert (tmp_path / "ray.log").read_text().count(death) == 1


def test_to_file_captures_the_process_and_its_children(tmp_path):
    log = tmp_path / "logs" / "w.log"
    code = (
        "import subprocess, sys; from async_grpo.logs import to_file; to_file();"
        " print('from the actor'); print('an error', file=sys.stderr); sys.stdout.flush();"
        " subprocess.run([sys.executable, '-c', 'print(\"from its child\")'], check=True)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, LOG_FILE_ENV: str(log)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == r.stderr == ""  # nothing reached the console
    text = Path(log).read_text()
    assert "from the actor" in text and "an error" in text and "from its child" in text
