"""An engine process ends with the actor that owns it (async_grpo/inference/owner.py), across
real processes: an owner spawns an "engine" that ignores SIGTERM and sleeps, as a stuck
engine core would; the owner is SIGKILLed; the engine must be gone within seconds, also
while it is stuck in a C call that holds the GIL (a regex here; in a CI run, an engine
core's shutdown hung in a process-group destructor), which a watcher thread could not
survive. Without the watcher the engine outlives its owner (so the test tells them apart).
The owner leads a process group of its own and the whole group gets SIGTERM after it dies,
as Ray does to a dead worker's group: the watcher must not die by it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

ENGINE = """
import os, re, signal, sys, time
from async_grpo.inference.owner import exit_with_owner
if sys.argv[1].startswith("watch"):
    assert exit_with_owner(poll_s=1.0)  # the group's SIGTERM comes first
# after the watcher starts, which would inherit an ignored signal (vLLM's handler it would not)
signal.signal(signal.SIGTERM, lambda *_: None)
print(os.getpid(), flush=True)
if sys.argv[1] == "watch-busy":  # stuck in C holding the GIL: no thread of it would run
    re.match(r"(a+)+$", "a" * 34 + "b")
time.sleep(600)
"""

OWNER = """
import subprocess, sys, time
from async_grpo.inference.owner import claim_engine_processes
claim_engine_processes()
engine = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
print(engine.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


def _engine_under_a_killed_owner(mode: str) -> tuple[int, bool]:
    """(engine pid, whether it is still running 5 s after its owner was SIGKILLed)."""
    from async_grpo.inference.owner import alive

    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, ENGINE, mode],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a group of its own, as Ray starts each worker
    )
    engine = int(owner.stdout.readline())
    assert alive(engine)
    time.sleep(0.5)  # the watcher is up (it ignores SIGTERM once its interpreter runs)
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait(timeout=30)
    os.killpg(owner.pid, signal.SIGTERM)  # Ray's sweep of a dead worker's process group
    assert alive(engine)  # it ignores SIGTERM, as an engine hung in its shutdown would
    deadline = time.monotonic() + 5
    while alive(engine) and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine, alive(engine)


@pytest.mark.parametrize("mode", ["watch", "watch-busy", "none"])
def test_an_engine_process_ends_with_its_owner(mode):
    engine, still_running = _engine_under_a_killed_owner(mode)
    if still_running:
        os.kill(engine, signal.SIGKILL)
    assert still_running == (mode == "none")


def test_no_watch_without_an_owner_or_in_the_owner(monkeypatch):
    from async_grpo.inference.owner import OWNER_ENV, exit_with_owner

    monkeypatch.delenv(OWNER_ENV, raising=False)
    assert not exit_with_owner()
    monkeypatch.setenv(OWNER_ENV, str(os.getpid()))
    assert not exit_with_owner()
