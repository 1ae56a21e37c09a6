import asyncio

import pytest

from async_grpo.batcher.channel import Channel, ChannelClosed
from async_grpo.batcher.rounds import fill_round


def test_channel_get_batch_up_to_target_weight():
    async def run():
        ch = Channel([0, 1], max_weight=100)
        for w in (10, 20, 30, 40):
            await ch.put(0, f"w{w}", w, timeout_s=1)
        first = await ch.get_batch(0, 35, timeout_s=1)  # 10 + 20 fits, + 30 would not
        second = await ch.get_batch(0, 5, timeout_s=1)  # always at least one item
        assert ch.queued(0) == 40 and ch.queued(1) == 0
        return first, second

    assert asyncio.run(run()) == (["w10", "w20"], ["w30"])


def test_channel_backpressure_and_timeouts_name_the_key():
    async def run():
        ch = Channel(["r0"], max_weight=10)
        await ch.put("r0", "a", 8, timeout_s=1)
        with pytest.raises(TimeoutError, match="channel key 'r0' stayed full"):
            await ch.put("r0", "b", 5, timeout_s=0.1)
        waiter = asyncio.ensure_future(ch.put("r0", "b", 5, timeout_s=2))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # blocked until the reader takes "a"
        assert await ch.get_batch("r0", 100, timeout_s=1) == ["a"]
        await waiter
        assert await ch.get_batch("r0", 100, timeout_s=1) == ["b"]
        with pytest.raises(TimeoutError, match="no item for channel key 'r0' within"):
            await ch.get_batch("r0", 1, timeout_s=0.1)
        with pytest.raises(KeyError, match="channel key 'r9'"):
            await ch.put("r9", "x", 1, timeout_s=1)

    asyncio.run(run())


def test_channel_close_drains_then_raises():
    async def run():
        ch = Channel([0], max_weight=10)
        await ch.put(0, "last", 1, timeout_s=1)
        await ch.close()
        assert await ch.get_batch(0, 1, timeout_s=1) == ["last"]
        with pytest.raises(ChannelClosed):
            await ch.get_batch(0, 1, timeout_s=1)
        with pytest.raises(ChannelClosed):
            await ch.put(0, "late", 1, timeout_s=1)

    asyncio.run(run())


def test_fill_round_fills_every_rank_or_waits():
    # 2 ranks x budget 100, fill target 95: [60, 40] and [50, 45] fill both bins
    bins = fill_round([60, 50, 45, 40, 10], num_ranks=2, budget=100)
    assert bins is not None
    sizes = sorted(sum([60, 50, 45, 40, 10][i] for i in b) for b in bins)
    assert sizes[0] >= 95 and sizes[1] <= 100
    assert fill_round([60, 50], num_ranks=2, budget=100) is None  # not enough yet
    with pytest.raises(ValueError, match="sample 1 has 101 tokens"):
        fill_round([5, 101], num_ranks=1, budget=100)


def test_split_group_keeps_shared_units_within_the_budget():
    from async_grpo.batcher.rounds import split_group
    from async_grpo.core.packing import packed_length

    lens = [30, 10, 40, 5, 25]
    assert split_group(20, lens, 100, share_prompts=False) == [[0], [1], [2], [3], [4]]
    units = split_group(20, lens, 100, share_prompts=True)
    assert units == [[0, 1], [2, 3, 4]]  # 19 + 31 + 11 = 61; adding 41 would make 102
    assert [i for u in units for i in u] == list(range(5))
    for u in units:
        assert packed_length(20, [lens[i] for i in u], True) <= 100


def test_a_reader_blocked_on_an_empty_queue_is_seen_by_until_a_reader_waits():
    async def main():
        ch = Channel([0, 1], 100)
        await ch.put(0, "a", 1, timeout_s=1)
        await ch.get_batch(0, 1, timeout_s=1)  # not blocked: an item was there
        waiter = asyncio.ensure_future(ch.until_a_reader_waits())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        reader = asyncio.ensure_future(ch.get_batch(1, 1, timeout_s=5))
        await asyncio.wait_for(waiter, 1)  # rank 1 now waits on its empty queue
        await ch.put(1, "b", 1, timeout_s=1)
        assert await reader == ["b"]

    asyncio.run(main())
