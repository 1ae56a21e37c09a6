"""On CUDA (skipped elsewhere): LoRA on the CUDA trainer path. A step of the FSDP2 policy
with rank-16 adapters in bf16 (checkpointed flex attention) moves the adapters alone; the
adapter payload the trainer pushes (`AdapterOnly`, trainer/payloads.py) crosses to another
process through the CUDA IPC slots bit-exact, with the protocol of trainer/push.py. The CPU
side of both: tests/unit/test_lora.py and the LoRA whole run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def _samples(n_groups: int = 2, vocab: int = 49152):
    from async_grpo.core.packing import PackInput

    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(n_groups):
        prompt = torch.randint(0, vocab, (120,), generator=g).tolist()
        for i in range(4):
            n = int(torch.randint(20, 200, (1,), generator=g))
            ids = torch.randint(0, vocab, (n,), generator=g).tolist()
            sample = PackInput(prompt, ids, 1.0, [0.0] * n)
            sample.advantage = 1.0 if (i + k) % 2 else -1.0
            out.append(sample)
    return out


@pytest.fixture(scope="module")
def lora_policy(tmp_path_factory):
    """A tiny Llama with rank-16 adapters on every linear layer, after one GRPO step, and
    its parameters before that step."""
    from _dist import one_rank_group
    from _tiny import tiny_llama

    from async_grpo.config import LoraConfig, LossConfig, TrainerConfig
    from async_grpo.core.attention import select_attention
    from async_grpo.core.loss import build_loss
    from async_grpo.core.packing import pack
    from async_grpo.trainer.model import build_optimizer, build_policy, full_state_dict

    folder = tmp_path_factory.mktemp("tiny")
    tiny_llama(seed=5).save_pretrained(folder)
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    groups = "cpu:gloo,cuda:nccl" if DEVICE == "cuda" else "gloo"
    attention = "flex" if DEVICE == "cuda" else "sdpa"
    with one_rank_group(groups, timeout_s=120):
        backend, _ = select_attention(attention, DEVICE, False, True, 4096)
        cfg = TrainerConfig(
            lr=1e-3,
            attention=attention,
            activation_checkpointing=DEVICE == "cuda",
            device=DEVICE,
            lora=LoraConfig(rank=16),
        )
        policy = build_policy(str(folder), cfg, torch.device(DEVICE), 1, backend)
        opt, _ = build_optimizer(policy, cfg)
        batch = backend.prepare(pack(_samples(), share_prompts=False)).to(DEVICE)
        before = {k: v.clone() for k, v in full_state_dict(policy).items()}
        logp, _ = policy(batch, False)
        loss, _ = build_loss(LossConfig(), 512)(logp, batch, 1, 1, None, 1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield policy, before, loss.detach()


def test_a_bf16_lora_step_moves_the_adapters_alone(lora_policy):
    from async_grpo.adapters import is_adapter
    from async_grpo.trainer.model import full_state_dict

    policy, before, loss = lora_policy
    assert torch.isfinite(loss)
    if DEVICE == "cuda":
        assert policy.precision.dtype == "bfloat16" and policy.checkpointing
    after = full_state_dict(policy)
    assert after.keys() == before.keys()
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    adapters = {k for k in after if is_adapter(k)}
    assert adapters and moved <= adapters, sorted(moved - adapters)[:3]
    assert {k for k in adapters if ".lora_B." in k} <= moved  # B starts at zero


def test_the_adapter_payload_crosses_to_another_process_bit_exact(lora_policy):
    from weight_sync import digest, ipc_round_trip

    from async_grpo.adapters import adapter_file_name, is_adapter
    from async_grpo.trainer.model import PREFIX
    from async_grpo.trainer.payloads import AdapterOnly, select_payload
    from async_grpo.trainer.push import _full
    from async_grpo.transports.base import TensorMeta, plan_chunks

    policy, _, _ = lora_policy
    payload = select_payload(policy)
    assert isinstance(payload, AdapterOnly)
    names = {
        adapter_file_name(n.removeprefix(PREFIX))
        for n, _ in policy.named_parameters()
        if is_adapter(n)
    }
    assert {w[0] for w in payload.wire} == names
    sent = []
    for name, shape, index, part in payload.wire:
        n = payload.sources[index]
        fulls = [_full(p).detach() for _, p in payload.params[index : index + n]]
        tensor = payload.build(index, fulls)[part].to(torch.bfloat16)
        assert tuple(tensor.shape) == shape and tensor.device.type == DEVICE
        sent.append((name, tensor))
    assert any(".lora_B." in n and t.abs().sum() > 0 for n, t in sent)
    if DEVICE != "cuda":
        return
    metas = [TensorMeta(n, tuple(t.shape), "bfloat16") for n, t in sent]
    chunks = plan_chunks(metas, limit=1)  # a chunk per layer: both slots
    assert len(chunks) == 2
    got, _ = ipc_round_trip(metas, [t for _, t in sent], chunks, pushes=2)
    assert got == {n: digest(t) for n, t in sent}
