"""`async-grpo worker / status / stop` against a real `ray start --head` cluster."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

pytestmark = pytest.mark.integration
CLI = [sys.executable, "-m", "async_grpo.cli"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head():
    """A private head node: `ray start --block` in the foreground, so that ending it ends
    exactly this cluster (`ray stop` would end every Ray process of the user)."""
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    temp = tempfile.mkdtemp(prefix="rg", dir="/tmp")  # short: Unix socket paths are limited
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.Popen(
        [
            ray_bin,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--include-dashboard=false",
            "--num-cpus=4",
            f"--object-store-memory={256 << 20}",
            f"--temp-dir={temp}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while (
        subprocess.run(
            [*CLI, "status", "--address", address], env=env, capture_output=True, timeout=120
        ).returncode
        != 0
    ):
        assert head.poll() is None and time.monotonic() < deadline, "ray head did not start"
        time.sleep(2)
    yield address, env
    head.terminate()
    head.wait(timeout=60)
    shutil.rmtree(temp, ignore_errors=True)


def _wait_for_line(proc, text, timeout_s=180):
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline and proc.poll() is None:
        seen.append(proc.stdout.readline())
        if text in seen[-1]:
            return
    raise AssertionError(f"no line {text!r} from the worker command: {''.join(seen)[-3000:]}")


def test_worker_status_stop(ray_head, tiny_model_dir):
    address, env = ray_head
    worker = subprocess.Popen(
        [
            *CLI,
            "worker",
            "--mode",
            "logprob",
            "--model",
            str(tiny_model_dir),
            "--num-workers",
            "2",
            "--address",
            address,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    verifier = subprocess.Popen(
        [*CLI, "worker", "--mode", "verifier", "--address", address],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for_line(worker, "2 logprob worker(s) registered")
        status = subprocess.run(
            [*CLI, "status", "--address", address],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert status.returncode == 0, status.stderr
        rows = [r for r in status.stdout.splitlines() if r.startswith("logprob")]
        assert len(rows) == 2 and all(" 0/256 " in r for r in rows), status.stdout
        _wait_for_line(verifier, "1 verifier worker(s) registered")
        status = subprocess.run(
            [*CLI, "status", "--address", address],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert sum(r.startswith("verifier") for r in status.stdout.splitlines()) == 1
        stop = subprocess.run(
            [*CLI, "stop", "--address", address],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "asked 3 worker(s) to drain and stop" in stop.stdout, stop.stderr
        assert worker.wait(timeout=60) == 0
        assert verifier.wait(timeout=60) == 0
    finally:
        worker.kill()
        verifier.kill()
    after = subprocess.run(
        [*CLI, "status", "--address", address], env=env, capture_output=True, text=True, timeout=120
    )
    assert after.stdout.strip() == "no workers registered", after.stdout


def test_no_cluster_is_one_line_exit_2():
    r = subprocess.run(
        [*CLI, "status", "--address", f"127.0.0.1:{_free_port()}"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("async-grpo: error: no Ray cluster at")
