"""The private Ray head of `async-grpo run` (`local_head.LocalHead`), started for real."""

import contextlib
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


def test_a_run_whose_head_cannot_start_stops_with_one_line(tiny_model_dir, tmp_path):
    """The real `async-grpo run`, in a process whose every free port is one this test holds:
    each try of the head fails at the GCS's bind, and the run ends with one cause line
    naming the head and what `ray start` said, exit 1, no traceback, no process left."""
    import psutil
    from _cli import run_command

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    tag = f"head-test-{os.getpid()}"
    cmd = run_command("quickstart.yaml", f"model={tiny_model_dir}", f"output_dir={tmp_path}")
    patched = (
        "import sys; import async_grpo.local_head as h; from async_grpo.cli import main;"
        f" h._free_port = lambda: {taken.getsockname()[1]}; h.LocalHead.TRIES = 2;"
        " sys.exit(main(sys.argv[1:]))"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", patched, *cmd[3:]], capture_output=True, text=True,
            timeout=300, env={**os.environ, "AGR_TEST_TAG": tag},
        )  # fmt: skip
    finally:
        taken.close()
    said = out.stdout + out.stderr
    assert out.returncode == 1, said[-4000:]
    lines = [x for x in said.splitlines() if x.strip()]
    cause = "async-grpo: error: the local Ray head did not start in 2 tries; `ray start` said:"
    assert lines[-1].startswith(f"{cause} server_ Failed to start the grpc server"), lines
    assert "Traceback" not in said, said[-4000:]
    left = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get("AGR_TEST_TAG") == tag:
                left.append(p.cmdline())
    assert not left, left
