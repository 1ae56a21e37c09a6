"""Catching up generation workers that serve an older version than the trainer's.

In: the generation registry's worker versions, read every VERSION_CHECK_S. Out: calls to
`push_now(version)` (once per version: the batcher sends every rank a `PushNow` between two
minibatches and the ranks push the weights they hold) and to `stall()` when no worker
serves the current version at all (the trainer's push is then the only way on).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from async_grpo.batcher.stats import POOL_STATS_TIMEOUT_S

VERSION_CHECK_S = 2.0  # how often the generation workers' versions are compared


async def watch_versions(
    registry: Any,
    version: Callable[[], int],
    stall: Callable[[], Awaitable[None]],
    push_now: Callable[[int], Awaitable[None]],
) -> None:
    """Run until cancelled: compare every worker's version with `version()` (-1: none yet)."""
    asked_for = -1  # the version a push was last asked for
    while True:
        await asyncio.sleep(VERSION_CHECK_S)
        current = version()
        if current < 0:
            continue
        try:
            async with asyncio.timeout(POOL_STATS_TIMEOUT_S):  # else skip this check
                workers = await registry.status.remote()
        except TimeoutError:
            print("batcher: the generation registry did not answer status", flush=True)
            continue
        behind = [w.worker_id for w in workers if w.version < current]
        if not behind:
            continue
        if not any(w.version >= current for w in workers):
            await stall()
        if asked_for < current:
            asked_for = current
            print(
                f"batcher: generation worker(s) {behind} serve a version before {current};"
                " asking the trainer to push now",
                flush=True,
            )
            await push_now(current)
