"""The private Ray head of `async-grpo run` and `async-grpo eval`: `ray start --head
--block` in a session of its own on a free port, and its stop, which ends every process
of that session at once."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import async_grpo.ray_utils  # noqa: F401  (token auth as every joining process has it)
from async_grpo.errors import MachineError

HEAD_START_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalHead:
    """A private Ray head node in the foreground (`ray start --block`): ending the process
    ends exactly this cluster."""

    TRIES = 3  # a free port can be taken before the head binds it (another run starting)

    def __init__(self, num_cpus: int, object_store_bytes: int, log_monitor: bool = True) -> None:
        """`log_monitor=False` where no driver streams its actors' output (`log_to_driver`):
        Ray's log monitor then only costs a process (about 1 CPU second a run)."""
        for tries_left in reversed(range(self.TRIES)):
            error = self._start(num_cpus, object_store_bytes, log_monitor)
            if error is None:
                return
            shutil.rmtree(self.temp, ignore_errors=True)
            if not tries_left:
                raise MachineError(
                    f"the local Ray head did not start in {self.TRIES} tries; `ray start`"
                    f" said: {_last_line(error)}"
                )

    def _gcs_failed(self) -> str:
        """The GCS's own line when it could not bind its port: `ray start` notices only
        after waiting about 40 s for it."""
        for log in Path(self.temp).glob("session_*/logs/gcs_server.out"):
            with contextlib.suppress(OSError):
                for line in log.read_text(errors="replace").splitlines():
                    if "Failed to start the grpc server" in line:
                        return line
        return ""

    def _start(self, num_cpus: int, object_store_bytes: int, log_monitor: bool) -> str | None:
        """Start the head on a free port; None once it listens, or its stderr if it exited
        (the GCS fails to start when another process took the port first)."""
        self.port = _free_port()
        self.temp = tempfile.mkdtemp(prefix="agr", dir="/tmp")  # Unix socket paths are short
        ray_bin = str(Path(sys.executable).with_name("ray"))
        said = Path(self.temp) / "ray-start.err"
        with said.open("wb") as err:
            self.proc = subprocess.Popen(
                [
                    ray_bin,
                    "start",
                    "--head",
                    "--block",
                    "--node-ip-address=127.0.0.1",
                    f"--port={self.port}",
                    "--include-dashboard=false",
                    "--no-monitor",  # a private head has no autoscaler: no process for one
                    f"--include-log-monitor={str(log_monitor).lower()}",
                    f"--num-cpus={num_cpus}",
                    f"--object-store-memory={object_store_bytes}",
                    f"--temp-dir={self.temp}",
                ],
                stdout=subprocess.DEVNULL,
                # a file, not a pipe: nobody reads a pipe while the head runs, and `ray start`
                # blocks once it has written a pipe's 64 KB (PYTHONPROFILEIMPORTTIME did it
                # before the head listened: the start timed out after 120 s)
                stderr=err,
                start_new_session=True,
            )
        self.address = f"127.0.0.1:{self.port}"
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while True:
            gcs_failed = self._gcs_failed()
            if gcs_failed or self.proc.poll() is not None:
                with contextlib.suppress(ProcessLookupError):  # what it started before failing
                    os.killpg(self.proc.pid, signal.SIGKILL)
                return gcs_failed or said.read_text(errors="replace")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return None
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise MachineError(
                        f"the local Ray head did not listen on {self.address} within"
                        f" {HEAD_START_TIMEOUT_S:.0f}s (a machine this loaded, or a port"
                        " it cannot open)"
                    ) from None
                time.sleep(0.5)

    def stop(self) -> None:
        """Kill the whole private cluster at once: every process of the head's session
        (`ray start` and what it started: the GCS and raylet in its process group, the
        workers in groups of their own, their engines and scoring processes), until none
        runs (up to 30 s). A SIGTERM to `ray start --block` took ~33 s to wind down
        processes whose state dies with this run anyway (tests/faults/test_signals.py)."""
        deadline = time.monotonic() + 30
        while (running := session_running(self.proc.pid)) and time.monotonic() < deadline:
            for pid in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)
        shutil.rmtree(self.temp, ignore_errors=True)


def _last_line(text: str, limit: int = 240) -> str:
    """The last line that says something, cut to `limit` characters; of a failed check in
    Ray's C++ (the GCS's "Check failed: ..."), what failed, without the preamble."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    line = lines[-1] if lines else "nothing"
    line = line.rpartition("Check failed:")[2].strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."


def session_running(sid: int) -> list[int]:
    """The processes of session `sid` that still run (a zombie has ended: its parent may
    never reap it where PID 1 does not)."""
    running = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = (proc / "stat").read_text().rpartition(")")[2].split()
                if int(fields[3]) == sid and fields[0] != "Z":  # state ppid pgrp session
                    running.append(int(proc.name))
    return running
