"""The private Ray head of `async-grpo run` (`local_head.LocalHead`), started for real."""

import os
import socket
import subprocess
import sys

import pytest

import async_grpo.local_head as run

pytestmark = pytest.mark.integration


def test_a_head_whose_port_was_taken_starts_again_on_another(monkeypatch):
    """Between picking a free port and the head binding it, another process (a second run
    starting, the other pytest worker) can take it; the GCS then fails and the head exits
    (seen in the default test run). The head is started again on a fresh port, and a real
    cluster answers there. The failed start is seen in the GCS's log within a second
    (`ray start` itself waits about 40 s for the dead GCS). Started as a quiet run starts
    it, the head runs no log monitor (nothing streams the actors' output). With Python's
    import times on, `ray start` writes more than a pipe holds (64 KB) before it listens:
    its stderr goes to a file, so it does not block (through a pipe it timed out)."""
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))  # bound, not listening: nothing answers there
    taken_port = taken.getsockname()[1]
    ports = iter([taken_port])
    real = run._free_port
    monkeypatch.setattr(run, "_free_port", lambda: next(ports, None) or real())
    try:
        head = run.LocalHead(num_cpus=1, object_store_bytes=80 << 20, log_monitor=False)
    finally:
        taken.close()
    try:
        assert head.port != taken_port
        cmd = "import ray; ray.init(address='{}'); print(ray.cluster_resources()['CPU'])"
        out = subprocess.run(
            [sys.executable, "-c", cmd.format(head.address)], capture_output=True, text=True,
            timeout=120, env={**os.environ, "RAY_AUTH_MODE": "disabled"},
        )  # fmt: skip
        assert out.stdout.strip().endswith("1.0"), out.stderr[-2000:]
        import psutil

        started = [" ".join(p.cmdline()) for p in psutil.Process(head.proc.pid).children(True)]
        assert any("gcs_server" in c for c in started), started
        assert not any("log_monitor" in c for c in started), started
        said = os.path.join(head.temp, "ray-start.err")
        assert os.path.getsize(said) > 64 << 10, os.path.getsize(said)
    finally:
        head.stop()
