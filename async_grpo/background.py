"""A task that nobody awaits (a serving loop, a heartbeat, a watchdog, a sweep): when it
ends by an error, that error is said at once, in one line naming the task, and `end` is
called with that line (an actor that cannot serve without the loop ends itself, so its pool
replaces it). Nothing is left for asyncio's "Task exception was never retrieved", which is
logged only whenever the collector frees the task: late, and on Python 3.11 from inside
whatever the collector interrupted (an `ast.parse` then fails with "AST constructor
recursion depth mismatch", CPython issue 106905's kind)."""

from __future__ import annotations

import asyncio
import sys
import traceback
from collections.abc import Callable, Coroutine
from typing import Any


def start(
    coro: Coroutine[Any, Any, Any], what: str, end: Callable[[str], None] | None = None
) -> asyncio.Task:
    """Run `coro` as a task of the running loop. A cancellation or a return is quiet; an
    error prints `<what> failed: <type>: <message>` and its traceback to stderr, then
    calls `end(line)`."""
    task = asyncio.get_running_loop().create_task(coro)
    task.add_done_callback(lambda t: _ended(t, what, end))
    return task


def _ended(task: asyncio.Task, what: str, end: Callable[[str], None] | None) -> None:
    if task.cancelled() or task.exception() is None:
        return
    e = task.exception()
    line = f"{what} failed: {type(e).__name__}: {e}"
    tb = "".join(traceback.format_exception(e))
    print(f"{line}\n{tb}", file=sys.stderr, end="", flush=True)
    if end is not None:
        end(line)
