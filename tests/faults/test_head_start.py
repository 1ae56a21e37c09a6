"""A run whose private Ray head cannot start: the real `async-grpo run`, in a process whose
every free port is one this test holds, so each try of the head fails at the GCS's bind.
The run ends with one cause line naming the head and what `ray start` said, exit 1, no
traceback, and nothing of it is left (about 13 s)."""

import socket
import sys

import pytest
from _cli import run_command
from _faults import assert_all_gone, finish, start

pytestmark = pytest.mark.faults


def test_a_run_whose_head_cannot_start_stops_with_one_line(tiny_model_dir, tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    cmd = run_command("quickstart.yaml", f"model={tiny_model_dir}", f"output_dir={tmp_path}")
    patched = (
        "import sys; import async_grpo.local_head as h; from async_grpo.cli import main;"
        f" h._free_port = lambda: {taken.getsockname()[1]}; h.LocalHead.TRIES = 2;"
        " sys.exit(main(sys.argv[1:]))"
    )
    try:
        proc, tag = start([sys.executable, "-c", patched, *cmd[3:]], tmp_path)
        out = finish(proc, tmp_path, timeout_s=300)
    finally:
        taken.close()
    assert proc.returncode == 1, out[-4000:]
    lines = [x for x in out.splitlines() if x.strip()]
    cause = "async-grpo: error: the local Ray head did not start in 2 tries; `ray start` said:"
    assert lines[-1].startswith(f"{cause} server_ Failed to start the grpc server"), lines
    assert "Traceback" not in out, out[-4000:]
    assert_all_gone(tag)
