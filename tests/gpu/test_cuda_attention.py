"""On CUDA (skipped elsewhere): packed bf16 log-probs and gradients of every attention
backend equal per-sample ones within bf16 rounding; a checkpointed flex step finishes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

pytestmark = pytest.mark.gpu


def _samples(n_groups: int = 3, vocab: int = 49152):
    from async_grpo.core.packing import PackInput

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n_groups):
        prompt = torch.randint(0, vocab, (150,), generator=g).tolist()
        for _ in range(8):
            n = int(torch.randint(20, 300, (1,), generator=g))
            out.append(
                PackInput(
                    prompt, torch.randint(0, vocab, (n,), generator=g).tolist(), 1.0, [0.0] * n
                )
            )
    return out


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("name", ["flex", "flash"])
def test_packed_bf16_logprobs_and_grads_match_per_sample(name, share):
    from _tiny import tiny_llama

    from async_grpo.core.attention import select_attention
    from async_grpo.core.logprobs import batch_logprobs
    from async_grpo.core.packing import pack

    try:
        backend, _ = select_attention(name, "cuda", share, True, 8192)
    except ValueError as e:
        pytest.skip(str(e))
    samples = _samples()
    ref_model = tiny_llama(seed=1).cuda().to(torch.bfloat16)
    want = []
    for s in samples:  # each sample alone, dense SDPA, no packing
        b = pack([s]).to("cuda")
        want.append(batch_logprobs(ref_model, b)[0][b.loss_mask].detach())
    model = (
        tiny_llama(seed=1, attn_implementation=backend.hf_implementation).cuda().to(torch.bfloat16)
    )
    batch = backend.prepare(pack(samples, share_prompts=share)).to("cuda")
    logp, _ = batch_logprobs(model, batch, attention=backend)
    logp.sum().backward()
    got, want = logp[batch.loss_mask].float(), torch.cat(want).float()
    # bf16 (8 mantissa bits): per-token log-probs of a 2-layer model agree to ~1e-2
    assert (got - want).abs().mean() < 1e-2 and (got - want).abs().max() < 0.1
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.fixture(scope="module")
def nccl_world():
    from _dist import one_rank_group

    torch.cuda.set_device(0)
    with one_rank_group("cpu:gloo,cuda:nccl", timeout_s=120):
        yield


def test_host_and_device_collectives_share_the_default_group(nccl_world):
    """The trainer all-reduces host counts and FSDP reduces device tensors in one group."""
    import torch.distributed as dist

    host = torch.tensor([1.0, 2.0], dtype=torch.float64)
    dist.all_reduce(host)
    dev = torch.ones(3, device="cuda")
    dist.all_reduce(dev)
    assert host.tolist() == [1.0, 2.0] and dev.tolist() == [1.0] * 3


def test_checkpointed_flex_step_finishes(nccl_world, tmp_path):
    """Activation checkpointing around flex layers: one 16k-token step within a minute."""
    from _tiny import tiny_llama

    from async_grpo.config import LossConfig, TrainerConfig
    from async_grpo.core.attention import select_attention
    from async_grpo.core.loss import build_loss
    from async_grpo.core.packing import pack
    from async_grpo.trainer.model import build_policy

    tiny_llama(seed=2).save_pretrained(tmp_path)
    backend, _ = select_attention("flex", "cuda", True, True, 16384)
    cfg = TrainerConfig(attention="flex", activation_checkpointing=True, device="cuda")
    policy = build_policy(str(tmp_path), cfg, torch.device("cuda"), 1, backend)
    assert policy.checkpointing and policy.precision.dtype == "bfloat16"
    loss_fn = build_loss(LossConfig(), 512)
    for rows in (12000, 16000):  # two buckets, two compilations
        batch = backend.prepare(pack(_samples(rows // 1300), share_prompts=True)).to("cuda")
        t = time.monotonic()
        logp, _ = policy(batch, False)
        loss, _ = loss_fn(logp, batch, 1, 1, None, 1)
        loss.backward()
        torch.cuda.synchronize()
        assert time.monotonic() - t < 60 and torch.isfinite(loss)
    assert backend.stats()["attention/row_shapes"] == 2


@pytest.mark.parametrize("kernels", ["liger", "compile"])
def test_faster_kernels_give_eager_logprobs_and_grads(nccl_world, tmp_path, kernels):
    """trainer.kernels: the same log-probs and gradients as eager (bf16 rounding), through
    the trainer's checkpointed flex path, under the same parameter names."""
    from _tiny import tiny_llama

    from async_grpo.config import TrainerConfig
    from async_grpo.core.attention import select_attention
    from async_grpo.core.packing import pack
    from async_grpo.trainer.model import build_policy

    if kernels == "liger":
        pytest.importorskip("liger_kernel")
    tiny_llama(seed=3).save_pretrained(tmp_path)
    backend, _ = select_attention("flex", "cuda", False, True, 8192)
    batch = backend.prepare(pack(_samples(2), share_prompts=False)).to("cuda")
    got = {}
    for k in ("eager", kernels):  # eager first: liger's rotary patch is process-wide
        cfg = TrainerConfig(
            attention="flex", activation_checkpointing=True, device="cuda", kernels=k
        )
        policy = build_policy(str(tmp_path), cfg, torch.device("cuda"), 1, backend)
        logp, _ = policy(batch, False)
        logp.sum().backward()
        grads = {n: p.grad.full_tensor().float() for n, p in policy.named_parameters()}
        got[k] = (logp.detach().float()[batch.loss_mask], grads)
    (want, want_g), (have, have_g) = got["eager"], got[kernels]
    assert want_g.keys() == have_g.keys()
    assert (have - want).abs().mean() < 1e-2 and (have - want).abs().max() < 0.1
    for name, g in want_g.items():
        rel = float((have_g[name] - g).norm() / g.norm().clamp(min=1e-6))
        assert rel < 0.05, f"{name}: gradient differs from eager by {rel:.3f} (relative)"
