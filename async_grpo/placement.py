"""Which CPU cores a process may run on: `generation.cpus`, `logprob.cpus`, `trainer.cpus`.

In: a core list as `taskset -c` writes it ("0", "0-3", "0,2-3"). Out: the process bound to
those cores, every thread of it, including the threads it has already started.

A process binds itself as it starts its real work (an engine before vLLM builds, a trainer
rank before torch starts its thread pool): `os.sched_setaffinity` on each thread of
/proc/self/task, so Ray's and gRPC's threads move too, and every thread started later (the
OpenMP pool, vLLM's scheduler loop) inherits the mask. vLLM's own binding
(VLLM_CPU_OMP_THREADS_BIND) binds only the OpenMP threads of a worker process of its own,
and leaves its scheduler, which busy-loops, on every core; an engine with `cpus` set runs
unbound by vLLM (docs/placement.md). The processes of one pool on a node share its cores.
"""

from __future__ import annotations

import os
from pathlib import Path

from async_grpo.errors import UserError


class PlacementError(UserError):
    """A core list that cannot be parsed or bound here (args: the message)."""


def parse_cpus(text: str, where: str) -> tuple[int, ...]:
    """The cores of a list like "0,2-3", sorted; `where` names the setting in errors."""
    cores: set[int] = set()
    for part in str(text).split(","):
        first, sep, last = part.strip().partition("-")
        try:
            lo, hi = int(first), int(last) if sep else int(first)
        except ValueError:
            raise PlacementError(
                f"{where}: {text!r} is not a core list (expected e.g. '0', '0-3' or '0,2-3')"
            ) from None
        if lo < 0 or hi < lo:
            raise PlacementError(f"{where}: {part.strip()!r} in {text!r} is not a core range")
        cores.update(range(lo, hi + 1))
    return tuple(sorted(cores))


def usable_cpus() -> set[int]:
    """The cores this process may run on (its affinity, which a container or taskset limits)."""
    return set(os.sched_getaffinity(0))


def bind_process(cores: tuple[int, ...], where: str) -> None:
    """Bind every thread of this process to `cores` (threads started later inherit it)."""
    mask = set(cores)
    try:
        os.sched_setaffinity(0, mask)
    except OSError as e:
        raise PlacementError(
            f"{where}: cannot bind to cores {compact(cores)} on node {node_name()}"
            f" ({e.strerror}; usable there: {compact(usable_cpus())})"
        ) from None
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), mask)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def node_name() -> str:
    """This node as `async-grpo status` names it (`ray_utils.node_label`) where Ray runs in
    this process, else its host name."""
    import socket
    import sys

    ray = sys.modules.get("ray")  # never imported here for this: placement stays below Ray
    if ray is not None and ray.is_initialized():
        from async_grpo.ray_utils import node_label

        return node_label()
    return socket.gethostname()


def process_cpus(pid: int | None = None) -> set[int]:
    """The cores any thread of process `pid` (this one by default) may run on."""
    tasks = Path(f"/proc/{pid or 'self'}/task")
    cores: set[int] = set()
    for task in tasks.iterdir():
        try:
            cores |= os.sched_getaffinity(int(task.name))
        except ProcessLookupError:
            continue
    return cores


def compact(cores: set[int] | tuple[int, ...]) -> str:
    """Cores as a taskset list: {0, 1, 2, 5} -> "0-2,5"."""
    out: list[str] = []
    for c in sorted(cores):
        if out and out[-1].split("-")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)
