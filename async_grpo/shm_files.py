"""What a run keeps in /dev/shm: every entry in one folder named by the run's id.

Two kinds of entry live there: the trainer's shared-memory weight slots
(transports/shm.py, `weights-*`) and the folders a generation worker serves its pushed
LoRA versions from (inference/adapter_versions.py, `adapters-*`). Each entry is named
`KIND-PID-RANDOM`, PID being the process that made it. `async-grpo run` names its run
(RUN_ID_ENV, which its ranks and every actor it or its ranks start inherit), so one sweep
removes what any of them left, however it ended:

- `remove_run`: the whole folder, when the run stops (its own cleanup, and its watchdog
  after `run` itself was SIGKILLed);
- `remove_orphans`: the entries whose process is gone, when a dead worker is replaced
  (an engine death, `ray.kill`, the OOM killer: the worker could not remove its own).

A process outside a run (a trainer started by hand, a test) makes its entries directly in
/dev/shm as `async-grpo-KIND-PID-RANDOM` and removes them itself.

One more kind cannot be named: the POSIX semaphores of Python's multiprocessing
(`sem.mp-RANDOM`), which vLLM's engine core makes. A process killed together with its
resource tracker (an engine core its dead worker takes along, the watchdog) cannot unlink
them; in use, a semaphore is always mapped by a process. So both sweeps (given the run's
start) also remove this user's `sem.mp-*` made or used since then that no live process
maps (`remove_orphan_semaphores`): the run's, or another's just as dead.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path

SHM_DIR = "/dev/shm"
# the run's id, set by `async-grpo run` (and `async-grpo worker`) for what it starts
RUN_ID_ENV = "ASYNC_GRPO_RUN_ID"


def shm_root() -> str:
    """/dev/shm where it exists (Linux), else the temporary folder."""
    return SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()


def run_folder(run_id: str, root: str | None = None) -> Path:
    """The folder of run `run_id`'s entries."""
    return Path(root or shm_root()) / f"async-grpo-run-{run_id}"


def new_entry(kind: str, root: str | None = None) -> str:
    """A fresh path for an entry of `kind` made by this process (nothing is created there):
    in its run's folder (created) when it belongs to a run, else directly in `root`."""
    tail = f"{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    run = os.environ.get(RUN_ID_ENV)
    if not run:
        return os.path.join(root or shm_root(), f"async-grpo-{tail}")
    folder = run_folder(run, root)
    folder.mkdir(mode=0o700, exist_ok=True)  # the run's own files (the workers: same user)
    return str(folder / tail)


def owner(entry: str | Path) -> int | None:
    """The id of the process that made `entry` (None for a name not made by `new_entry`)."""
    parts = Path(entry).name.rsplit("-", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def left(run_id: str, root: str | None = None) -> list[str]:
    """The entries of run `run_id` that exist now."""
    folder = run_folder(run_id, root)
    return sorted(str(p) for p in folder.iterdir()) if folder.is_dir() else []


def remove_run(run_id: str, root: str | None = None, since: float | None = None) -> int:
    """Remove every entry of run `run_id`, and its folder; how many entries there were.
    With `since` (the run's start, a time.time()), also the orphaned semaphores."""
    found = left(run_id, root)
    shutil.rmtree(run_folder(run_id, root), ignore_errors=True)
    if since is not None:
        found += remove_orphan_semaphores(since, root)
    return len(found)


def remove_orphans(run_id: str, root: str | None = None, since: float | None = None) -> list[str]:
    """Remove the entries of run `run_id` whose process is gone; the paths removed (with
    `since`, the orphaned semaphores too). (The run's processes are on this node: the
    folder is this node's /dev/shm.)"""
    removed = [] if since is None else remove_orphan_semaphores(since, root)
    for entry in left(run_id, root):
        pid = owner(entry)
        if pid is None or _alive(pid):
            continue
        if os.path.isdir(entry):
            shutil.rmtree(entry, ignore_errors=True)
        else:
            Path(entry).unlink(missing_ok=True)
        removed.append(entry)
    return removed


def remove_orphan_semaphores(since: float, root: str | None = None) -> list[str]:
    """Remove this user's multiprocessing semaphores (`sem.mp-*`) modified since `since`
    that no live process maps; the paths removed."""
    root = root or shm_root()
    found: dict[int, Path] = {}  # inode -> path
    for path in Path(root).glob("sem.mp-*"):
        with contextlib.suppress(FileNotFoundError):
            st = path.stat()
            if st.st_uid == os.getuid() and st.st_mtime >= since:
                found[st.st_ino] = path
    if found:
        for inode in _mapped_inodes(root):
            found.pop(inode, None)
    for path in found.values():
        path.unlink(missing_ok=True)
    return sorted(str(p) for p in found.values())


def _mapped_inodes(root: str) -> set[int]:
    """Inodes of files under `root` that live processes map (glibc maps a semaphore under
    a temporary name, then links it to its own: the inode is what they share)."""
    inodes = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # gone, or not ours to read
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(f"{root}/"):
                    inodes.add(int(fields[4]))
    return inodes


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # some other user's process: alive
        return True
    return True
