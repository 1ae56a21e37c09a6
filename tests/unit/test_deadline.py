"""`deadline.within` ends its wait by the deadline even where the awaited code loses the
cancellation (CPython issue 86296: on 3.10 and 3.11 an inner `asyncio.wait_for` whose future
completes in the same turn of the loop as the cancellation swallows it)."""

import asyncio
import sys
import time

import pytest

from async_grpo.deadline import within


async def _swallows_its_cancellation() -> str:
    """An inner `wait_for` whose future completes while the loop is busy past the outer
    deadline, then a second of work after the deadline."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def busy_then_done():
        time.sleep(0.05)  # the loop is held past the 0.01 s deadline...
        fut.set_result(1)  # ...and the inner future completes in that same turn

    loop.call_later(0.001, busy_then_done)
    await asyncio.wait_for(fut, 5)
    await asyncio.sleep(1.0)
    return "late"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's wait_for keeps cancellations")
def test_asyncio_timeout_waits_for_code_that_swallowed_its_cancellation():
    """The failure `within` exists for, as this Python has it: `asyncio.timeout` returns the
    late result a second past its deadline."""

    async def main():
        t = time.monotonic()
        async with asyncio.timeout(0.01):
            out = await _swallows_its_cancellation()
        return out, time.monotonic() - t

    out, seconds = asyncio.run(main())
    assert out == "late" and seconds >= 1.0


def test_within_raises_at_its_deadline_whatever_the_code_does():
    async def main():
        t = time.monotonic()
        with pytest.raises(TimeoutError):
            await within(_swallows_its_cancellation(), 0.01)
        return time.monotonic() - t

    assert asyncio.run(main()) < 0.9  # not the second of work after the deadline


def test_within_returns_the_result_and_raises_the_error_in_time():
    async def value():
        await asyncio.sleep(0.01)
        return 7

    async def error():
        await asyncio.sleep(0.01)
        raise ValueError("bad")

    async def main():
        assert await within(value(), 5) == 7
        with pytest.raises(ValueError, match="bad"):
            await within(error(), 5)

    asyncio.run(main())


def test_a_cancelled_caller_cancels_what_it_waited_for():
    ended = []

    async def slow():
        try:
            await asyncio.sleep(10)
        finally:
            ended.append(True)

    async def main():
        waiter = asyncio.ensure_future(within(slow(), 30))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert ended == [True]
