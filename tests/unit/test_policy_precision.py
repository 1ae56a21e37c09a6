"""FSDP2 mixed precision in the trainer's policy: bf16 forward/backward, fp32 master weights.

One gloo process (world size 1) shards a tiny Llama exactly as the trainer does."""

from __future__ import annotations

import pytest
import torch
from _dist import one_rank_group
from _tiny import tiny_llama

from async_grpo.config import TrainerConfig
from async_grpo.core.packing import PackInput, pack
from async_grpo.trainer.model import build_optimizer, build_policy


@pytest.fixture(scope="module")
def gloo_world():
    with one_rank_group("gloo"):
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(seed=3).save_pretrained(path)
    return str(path)


def _batch():
    g = torch.Generator().manual_seed(0)
    samples = [
        PackInput(
            prompt_ids=torch.randint(0, 49152, (n,), generator=g).tolist(),
            completion_ids=torch.randint(0, 49152, (m,), generator=g).tolist(),
            advantage=a,
            behaviour_logprobs=[-10.8] * m,
        )
        for n, m, a in [(5, 7, 1.0), (3, 9, -0.5), (6, 4, 0.25)]
    ]
    return pack(samples)


def _moved_fraction(policy, before) -> float:
    """Share of decoder-layer weights an optimizer step changed (every one has a gradient;
    embedding rows of tokens absent from the batch do not)."""
    moved = total = 0
    for n, p in policy.named_parameters():
        if ".layers." not in n:
            continue
        moved += (p.detach().full_tensor() != before[n]).sum().item()
        total += p.numel()
    return moved / total


def _policy(model_dir, **kw):
    return build_policy(model_dir, TrainerConfig(**kw), torch.device("cpu"), 1)


def test_bf16_compute_keeps_fp32_master_weights(gloo_world, model_dir):
    batch = _batch()
    ref_logp, _ = _policy(model_dir, compute_dtype="float32")(batch, False)
    policy = _policy(model_dir, compute_dtype="bfloat16")
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    logp, _ = policy(batch, False)
    mask = batch.loss_mask
    assert logp.dtype == torch.float32
    err = (logp - ref_logp)[mask].abs().max().item()
    assert 1e-6 < err < 0.1, err  # computed in bf16: close to fp32, but not bit-equal
    (-(logp * mask).sum()).backward()
    assert {p.grad.dtype for p in policy.parameters()} == {torch.float32}

    # An update far below bf16's resolution (8 bits of mantissa) survives in fp32 masters.
    before = {n: p.detach().full_tensor().clone() for n, p in policy.named_parameters()}
    opt, _ = build_optimizer(policy, TrainerConfig(lr=1e-7))
    opt.step()
    assert _moved_fraction(policy, before) > 0.95
    for n, p in policy.named_parameters():
        step = (p.detach().full_tensor() - before[n]).abs().max().item()
        assert step < 2e-7, (n, step)  # Adam's first step is lr in size


def test_bf16_parameters_lose_the_same_update(gloo_world, model_dir):
    policy = _policy(model_dir, dtype="bfloat16")
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}
    batch = _batch()
    logp, _ = policy(batch, False)
    (-(logp * batch.loss_mask).sum()).backward()
    before = {n: p.detach().full_tensor().clone() for n, p in policy.named_parameters()}
    opt, _ = build_optimizer(policy, TrainerConfig(lr=1e-7))
    opt.step()
    assert _moved_fraction(policy, before) < 0.05  # most bf16 weights cannot move by 1e-7


def test_auto_compute_dtype_follows_the_cpu(gloo_world, model_dir, monkeypatch):
    from async_grpo import precision

    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(precision, "native_bf16", lambda device, n=native: (n, "probe"))
        policy = _policy(model_dir)  # compute_dtype defaults to auto
        assert policy.precision.torch_dtype == want and "auto" in policy.precision.reason
        assert {p.dtype for p in policy.parameters()} == {torch.float32}
    policy = _policy(model_dir, dtype="bfloat16")  # auto never computes wider than masters
    assert policy.precision.dtype == "bfloat16"


def test_activation_checkpointing_changes_no_gradient_or_name(gloo_world, model_dir):
    batch = _batch()
    grads, names = [], []
    for ac in (False, True):
        policy = _policy(model_dir, compute_dtype="float32", activation_checkpointing=ac)
        assert policy.checkpointing is ac
        calls = []
        policy.hf.model.layers[0].mlp.register_forward_pre_hook(lambda *a, c=calls: c.append(1))
        logp, ent = policy(batch, True)
        (-(logp * batch.advantages).sum() + 0.1 * ent.sum()).backward()
        assert len(calls) == (2 if ac else 1)  # recomputed in the backward
        grads.append(torch.cat([p.grad.full_tensor().flatten() for p in policy.parameters()]))
        names.append(sorted(n for n, _ in policy.named_parameters()))
    assert names[0] == names[1]  # checkpoints and weight pushes see the same names
    assert grads[0].abs().max() > 1e-4
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-5), (
        (grads[0] - grads[1]).abs().max()
    )
