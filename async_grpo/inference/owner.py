"""An engine's processes end with the worker that owns them.

vLLM's AsyncLLM runs its engine core in a process of its own (and, with tensor parallelism,
workers under it). When the owning Ray actor is killed (SIGKILL, the OOM killer), those
processes are orphaned and may take their time to notice, or hang in their shutdown. One
that still holds a weight-broadcast group keeps its sockets open, and a member waiting for
bytes relayed through it waits out the group's timeout (300 s): the push cannot start over
until then. So the actor names itself in the environment its engine inherits, and each
engine process that receives weights starts a small watcher process that SIGKILLs it
(nothing to hang on) as soon as the actor is gone. The watcher is a process, not a thread:
an engine stuck in a C call that holds the GIL (seen: a shutdown hung in a process-group
destructor) would starve a thread.

The watcher runs in a session of its own and ignores the polite stop signals. Ray puts each
worker in a process group of its own and, once the worker is gone, sends SIGTERM to the
whole group: a watcher in that group would die by it, while the engine it watches may hang
in the shutdown that SIGTERM starts. Only the watcher's own two exits end it: the engine
gone, or the engine killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

OWNER_ENV = "ASYNC_GRPO_ENGINE_OWNER"


def claim_engine_processes() -> None:
    """In the actor, before it starts its engine: the engine's processes watch this one."""
    os.environ[OWNER_ENV] = str(os.getpid())


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True  # no /proc here: the signal test above is all there is


def exit_with_owner(poll_s: float = 0.5) -> bool:
    """In an engine process: have it killed once the owner named in the environment is
    gone, by a small watcher process (which ends with the engine). False (and nothing
    started) where no owner is named, or this process is it."""
    owner = int(os.environ.get(OWNER_ENV) or 0)
    if not owner or owner == os.getpid():
        return False
    # a process, not a thread: an engine stuck in a C call that holds the GIL (a shutdown
    # hung in a process-group destructor) would starve a thread
    subprocess.Popen(
        [sys.executable, "-m", __name__, str(owner), str(os.getpid()), str(poll_s)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
        start_new_session=True,  # out of the owner's process group: a group SIGTERM misses it
    )
    return True


def watch(owner: int, engine: int, poll_s: float) -> None:
    """The watcher's loop: SIGKILL `engine` once `owner` is gone; end with the engine."""
    while alive(engine):
        if not alive(owner):
            os.kill(engine, signal.SIGKILL)
            return
        time.sleep(poll_s)


if __name__ == "__main__":  # the watcher process
    for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(stop, signal.SIG_IGN)
    watch(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
