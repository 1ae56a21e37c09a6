"""Fault injection: named points in the code where a process kills itself, once per run.

The fault suite (tests/faults) sets two environment variables, which every process of a
run inherits (the Ray head and its actors, the torchrun ranks):

    ASYNC_GRPO_FAULTS=<point>@<k>[,<point>@<k>...]   e.g. generation.load_chunk@1
    ASYNC_GRPO_FAULT_DIR=<folder>                    where fired faults are marked

The k-th time a process reaches `point` it sends itself SIGKILL (what the OOM killer
sends: no cleanup, no exception), after creating <folder>/<point>. The mark makes each
fault fire once per run: a replacement process inherits the same environment and runs
clean. Without the variables `fault_point` returns at once.

Points: generation.load_chunk (a worker dies during a weight push, before loading a
chunk), generation.generate, verifier.score, logprob.logprobs, environment.step (a worker
dies holding a request), environment.acquire (while making a group's instances),
trainer.step (a trainer rank dies mid-step, after the forward/backward of its minibatches).
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

_reached: Counter[str] = Counter()


def fault_point(point: str) -> None:
    spec = os.environ.get("ASYNC_GRPO_FAULTS")
    if not spec:
        return
    wanted = dict(item.partition("@")[::2] for item in spec.split(","))
    if point not in wanted:
        return
    _reached[point] += 1
    if _reached[point] != int(wanted[point] or 1):
        return
    mark = Path(os.environ.get("ASYNC_GRPO_FAULT_DIR", "/tmp")) / f"fault-{point}"
    try:
        fd = os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # fired already in this run
    os.write(fd, f"pid {os.getpid()}\n".encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)
