"""Log-prob workers on a real local Ray cluster, with a tiny random llama."""

import asyncio

import pytest
import torch

from async_grpo.config import LogprobConfig
from async_grpo.inference.types import RequestError

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def worker(cluster, tiny_model_dir):
    from async_grpo.pools import start_logprob_workers, stop_workers

    (w,) = start_logprob_workers(
        str(tiny_model_dir), LogprobConfig(max_tokens_per_batch=64, dtype="float32"), 1
    )
    yield w
    stop_workers([w], drain_timeout_s=5)


def _reference(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # [L, V]
    logp = torch.log_softmax(logits, -1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


def test_batched_logprobs_match_one_at_a_time(worker, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from async_grpo.inference.client import PoolClient

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    pairs = [
        (
            torch.randint(0, 49152, (5 + i % 7,), generator=g).tolist(),
            torch.randint(0, 49152, (3 + i % 5,), generator=g).tolist(),
        )
        for i in range(24)
    ]
    client = PoolClient("logprob")

    async def run():  # 24 concurrent callers; the worker packs them into 64-token rows
        return await asyncio.gather(*[client.call(1, "logprobs", [p]) for p in pairs])

    results = [r[0] for r in asyncio.run(run())]
    for (p, c), got in zip(pairs, results, strict=True):
        assert len(got) == len(c)
        assert max(abs(a - b) for a, b in zip(got, _reference(model, p, c), strict=True)) < 1e-4


def test_a_sample_over_the_budget_is_scored_alone(worker, tiny_model_dir):
    """70 tokens > max_tokens_per_batch=64: scored in a row of its own, beside packed short
    ones, not refused (a refusal drops the whole group with the KL penalty on)."""
    import ray
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    long_pair = (list(range(1, 61)), list(range(100, 110)))
    short = ([1, 2, 3], [4, 5])
    refs = [worker.logprobs.remote([short]), worker.logprobs.remote([long_pair, short])]
    first, (long_lp, short_lp) = ray.get(refs, timeout=120)
    assert len(long_lp) == 10
    assert (
        max(abs(a - b) for a, b in zip(long_lp, _reference(model, *long_pair), strict=True)) < 1e-4
    )
    assert first[0] == pytest.approx(short_lp, abs=1e-5)


def test_a_sample_over_the_model_context_fails_alone(worker):
    import ray

    with pytest.raises(RequestError, match="exceeds the model context"):
        ray.get(worker.logprobs.remote([([1] * 2100, [2] * 10)]), timeout=120)
    assert len(ray.get(worker.logprobs.remote([([1, 2, 3], [4, 5])]), timeout=120)[0]) == 2


def test_a_serving_loop_that_dies_ends_its_worker(worker):
    """Last in this module (it ends the module's worker). An error outside the forward's
    own handling (here an item the loop cannot read) used to end the serving loop without a
    word: the actor stayed up, registered, and every later caller waited out its timeout.
    Now the worker says `<id>: serving loop failed: ...; this worker ends` and its process
    ends, so Ray reports it dead and a run's supervisor starts another."""
    import ray
    from _ray import seconds_until_dead

    ray.get(worker.ping.remote(), timeout=30)
    ray.get(worker.__ray_call__.remote(lambda self: self._queue.put_nowait(None)), timeout=30)
    seconds_until_dead(worker, 60, "the worker whose serving loop failed")
