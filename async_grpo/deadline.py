"""A wait that ends by its deadline whatever the awaited code does with a cancellation.

`asyncio.timeout` and `asyncio.wait_for` end a wait by cancelling what they wait for, and
wait for it to end. On Python 3.11 (and 3.10), an `asyncio.wait_for` inside that code
whose own future completes in the same turn of the loop as the cancellation swallows the
cancellation (CPython issue 86296, fixed by 3.12's rewrite of `wait_for`): the code goes
on, and the outer wait ends only when it does. Our pool client waits with `wait_for`
inside, and so may any environment's or harness's code. `within` waits with
`asyncio.wait` instead, which never absorbs a cancellation, cancels the task at the
deadline, gives it `grace_s` to unwind (a lease released, a file closed) and raises
`TimeoutError` either way; a task that swallowed its cancellation ends on its own, its
result or error dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")
GRACE_S = 1.0  # how long a cancelled task may take to unwind before the wait gives up


def mark_seen(task: asyncio.Future) -> None:
    """Retrieve an abandoned task's outcome, so asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


async def within(aw: Awaitable[T], timeout_s: float, grace_s: float = GRACE_S) -> T:
    """`await aw`, raising `TimeoutError` once `timeout_s` (plus at most `grace_s` for its
    cancellation) has passed; a cancellation of the caller cancels `aw` too."""
    task: asyncio.Future[Any] = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not done:
            task.cancel()
            await asyncio.wait({task}, timeout=grace_s)
    except asyncio.CancelledError:
        task.cancel()
        task.add_done_callback(mark_seen)
        raise
    if done:
        return task.result()
    task.add_done_callback(mark_seen)
    raise TimeoutError(f"not done within {timeout_s:g} s")
