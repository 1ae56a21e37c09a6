"""The log-prob worker's batching loop outlives a failed forward whose caller is gone:
it must not call set_exception on a cancelled future (that ended the loop, and every
later request waited out its 1,800 s timeout)."""

from __future__ import annotations

import asyncio

from _tiny import tiny_llama

from async_grpo.config import LogprobConfig
from async_grpo.inference.logprob import LogprobWorker


def test_serving_goes_on_after_a_failed_forward_of_a_cancelled_caller(tmp_path):
    tiny_llama(seed=1).save_pretrained(tmp_path)

    async def main():
        worker = LogprobWorker(str(tmp_path), LogprobConfig(dtype="float32"), "lp-test")
        await worker.start(register=False)
        real = worker._score
        calls = []

        def failing_once(batch):
            calls.append(len(batch))
            if len(calls) == 1:
                import time

                time.sleep(0.3)  # the caller is cancelled meanwhile
                raise RuntimeError("out of memory")
            return real(batch)

        worker._score = failing_once
        first = asyncio.ensure_future(worker.logprobs([([1, 2, 3], [4, 5])]))
        await asyncio.sleep(0.1)
        first.cancel()
        second = await asyncio.wait_for(worker.logprobs([([1, 2], [3, 4, 5])]), 30)
        await worker.stop(1.0)
        return calls, second

    calls, second = asyncio.run(main())
    assert calls == [1, 1] and len(second[0]) == 3
