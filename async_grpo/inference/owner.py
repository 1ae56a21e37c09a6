"""An engine's processes end with the worker that owns them.

vLLM's AsyncLLM runs its engine core in a process of its own (and, with tensor parallelism,
workers under it). When the owning Ray actor is killed (SIGKILL, the OOM killer), those
processes are orphaned and may take their time to notice, or hang in their shutdown. One
that still holds a weight-broadcast group keeps its sockets open, and a member waiting for
bytes relayed through it waits out the group's timeout (300 s): the push cannot start over
until then. So the actor names itself in the environment its engine inherits, and each
engine process that receives weights kills itself (SIGKILL: nothing to hang on) as soon as
that process is gone.
"""

from __future__ import annotations

import os
import signal
import threading
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
    """In an engine process: kill this process once the owner named in the environment is
    gone. False (and nothing started) where no owner is named, or this process is it."""
    owner = int(os.environ.get(OWNER_ENV) or 0)
    if not owner or owner == os.getpid():
        return False

    def watch() -> None:
        while alive(owner):
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="exit-with-owner", daemon=True).start()
    return True
