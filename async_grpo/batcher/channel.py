"""Channel: the batcher-to-trainer hop, one queue per key (trainer rank).

`put` adds an item with a weight (its token count) and waits while the key already holds
`max_weight` (backpressure); `get_batch` returns queued items up to a target weight (at
least one). `close` lets readers drain what is queued, then raises `ChannelClosed`.
Plain asyncio, so it is tested alone and lives inside the batcher actor.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class ChannelClosed(Exception):
    """The channel was closed and the key has nothing left to read."""


class Channel:
    def __init__(self, keys: list[Any], max_weight: int) -> None:
        if max_weight <= 0:
            raise ValueError(f"max_weight must be > 0, got {max_weight}")
        self.max_weight = max_weight
        self._queues: dict[Any, deque[tuple[Any, int]]] = {k: deque() for k in keys}
        self._weight = dict.fromkeys(keys, 0)
        self._changed = asyncio.Condition()
        self._closed = False
        self._readers_waiting = 0  # get_batch calls blocked on an empty queue

    def _check_key(self, key: Any) -> None:
        if key not in self._queues:
            raise KeyError(f"channel key {key!r} is not one of {list(self._queues)}")

    async def put(self, key: Any, item: Any, weight: int, timeout_s: float) -> None:
        """Queue `item`; waits (up to `timeout_s`) while the key is full."""
        self._check_key(key)
        async with self._changed:
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel
                async with asyncio.timeout(timeout_s):
                    await self._changed.wait_for(
                        lambda: (
                            self._closed
                            or not self._queues[key]
                            or self._weight[key] + weight <= self.max_weight
                        )
                    )
            except TimeoutError:
                raise TimeoutError(
                    f"channel key {key!r} stayed full ({self._weight[key]} of {self.max_weight})"
                    f" for {timeout_s:.0f}s: is its reader alive?"
                ) from None
            if self._closed:
                raise ChannelClosed(f"put on closed channel (key {key!r})")
            self._queues[key].append((item, weight))
            self._weight[key] += weight
            self._changed.notify_all()

    async def get_batch(self, key: Any, target_weight: int, timeout_s: float) -> list[Any]:
        """At least one item, then more while their total weight stays <= `target_weight`."""
        self._check_key(key)
        queue = self._queues[key]
        async with self._changed:
            blocked = not (self._closed or queue)
            if blocked:
                self._readers_waiting += 1
                self._changed.notify_all()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._changed.wait_for(lambda: self._closed or bool(queue))
            except TimeoutError:
                raise TimeoutError(
                    f"no item for channel key {key!r} within {timeout_s:.0f}s"
                ) from None
            finally:
                self._readers_waiting -= blocked
            if not queue:
                raise ChannelClosed(f"channel closed (key {key!r})")
            items, total = [], 0
            while queue and (not items or total + queue[0][1] <= target_weight):
                item, weight = queue.popleft()
                items.append(item)
                total += weight
            self._weight[key] -= total
            self._changed.notify_all()
            return items

    async def until_a_reader_waits(self) -> None:
        """Return once some reader is blocked in `get_batch` on an empty queue (it needs
        items now), or the channel is closed. No timeout here: the caller bounds the wait."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._closed or self._readers_waiting > 0)

    def queued(self, key: Any) -> int:
        return self._weight[key]

    async def close(self) -> None:
        async with self._changed:
            self._closed = True
            self._changed.notify_all()
