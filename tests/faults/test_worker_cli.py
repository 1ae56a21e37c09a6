"""`async-grpo worker` on a cluster node: a worker it started that dies is replaced (the
same supervisor as `async-grpo run`), and SIGHUP or SIGTERM stops its workers like Ctrl-C,
exit 128 + the signal, leaving no worker process behind."""

import os
import signal
import subprocess
import time

import pytest
from _cli import CLI, wait_for_line
from _ray import my_processes

pytestmark = pytest.mark.faults


def _verifier_pids() -> set[int]:
    return my_processes("ray::VerifierWorker")


@pytest.mark.parametrize(
    "sig",
    [pytest.param(signal.SIGHUP, marks=pytest.mark.slow), signal.SIGTERM],  # one handler
    ids=lambda s: s.name,
)
def test_a_worker_command_replaces_the_dead_and_stops_on_a_signal(ray_head, sig):
    address, env = ray_head
    before = _verifier_pids()
    proc = subprocess.Popen(
        [*CLI, "worker", "--mode", "verifier", "--address", address],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_line(proc, "1 verifier worker(s) registered")
        (victim,) = _verifier_pids() - before
        os.kill(victim, signal.SIGKILL)
        wait_for_line(proc, "pool 'verifier': a worker died; started a new one (1/3 restarts)", 60)
        assert len(_verifier_pids() - before - {victim}) == 1
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, out[-3000:]
    assert "verifier workers stopped" in out
    deadline = time.monotonic() + 60
    while (left := _verifier_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"verifier workers left behind: {left}"
