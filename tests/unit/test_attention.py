"""Attention backends: packed log-probs equal per-sample ones for every backend that runs
here (fp32, 1e-5), shared prompts and padding included; the picker's choices and refusals."""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_llama

from async_grpo.core import attention as attn
from async_grpo.core.attention import DenseAttention, select_attention
from async_grpo.core.attention.flex import FlexAttention
from async_grpo.core.logprobs import batch_logprobs
from async_grpo.core.packing import PackInput, pack, pad_to


def _samples() -> list[PackInput]:
    """Two GRPO groups (prompts of 9 and 4 tokens) and one lone sample."""
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, 49152, (n,), generator=g).tolist()  # noqa: E731
    prompts = [rand(9), rand(4), rand(6)]
    out = []
    for prompt, lens in zip(prompts, [(5, 3, 7), (2, 6), (4,)], strict=True):
        out += [PackInput(prompt, rand(n), 1.0, [0.0] * n) for n in lens]
    return out


@pytest.fixture(scope="module")
def per_sample() -> list[torch.Tensor]:
    """Each sample's log-probs from its own row (dense SDPA, no packing at all)."""
    model = tiny_llama(seed=1)
    with torch.no_grad():
        return [batch_logprobs(model, b)[0][b.loss_mask] for b in (pack([s]) for s in _samples())]


BACKENDS = {
    "sdpa": lambda: DenseAttention(),
    "flex": lambda: FlexAttention(max_tokens=512),
}


@pytest.mark.parametrize("share", [False, True], ids=["unshared", "shared"])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_packed_logprobs_equal_per_sample(name, share, per_sample):
    backend = BACKENDS[name]()
    model = tiny_llama(seed=1, attn_implementation=backend.hf_implementation)
    batch = backend.prepare(pack(_samples(), share_prompts=share))
    with torch.no_grad():
        logp, _ = batch_logprobs(model, batch, attention=backend)
    got = logp[batch.loss_mask]  # sample order
    want = torch.cat(per_sample)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    if name == "flex":  # padded to the bucket; padding carries no loss token
        assert batch.input_ids.shape[1] % backend.bucket == 0
        assert int(batch.loss_mask.sum()) == want.numel()


def test_pad_to_changes_no_log_prob_or_count():
    batch = pack(_samples(), share_prompts=True)
    padded = pad_to(batch, batch.input_ids.shape[1] + 37, pad_token_id=2)
    t = batch.input_ids.shape[1]
    assert padded.input_ids.shape == (1, t + 37) and padded.seq_lens[-1] == 37
    assert padded.position_ids[0, t:].tolist() == list(range(37))
    assert (padded.sample_index[t:] == batch.num_samples).all()
    assert not padded.loss_mask[t:].any() and not padded.shared_prefix[t:].any()
    assert (padded.num_tokens, padded.num_samples) == (batch.num_tokens, batch.num_samples)
    model = tiny_llama(seed=1)
    with torch.no_grad():
        a = batch_logprobs(model, batch)[0][batch.loss_mask]
        b = batch_logprobs(model, padded)[0][padded.loss_mask]
    assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError, match="cannot pad"):
        pad_to(batch, t - 1)


def test_flex_row_shapes_are_bounded():
    backend = FlexAttention(max_tokens=4096)
    assert backend.bucket == 512
    for n in range(1, 4097, 37):
        s = PackInput([1], [2] * n, 0.0, [0.0] * n)
        backend.prepare(pack([s]))
    assert backend.stats()["attention/row_shapes"] <= 8


def test_auto_picks_by_device(monkeypatch):
    b, why = select_attention("auto", "cpu", share_prompts=True, training=True, max_tokens=512)
    assert isinstance(b, DenseAttention) and "CPU" in why
    monkeypatch.setattr(attn, "flash_attn_installed", lambda: False)
    b, why = select_attention("auto", "cuda", False, True, 4096)
    assert b.name == "flex" and "not installed" in why
    monkeypatch.setattr(attn, "flash_attn_installed", lambda: True)
    assert select_attention("auto", "cuda", False, True, 4096)[0].name == "flash"
    b, why = select_attention("auto", "cuda", True, True, 4096)
    assert b.name == "flex" and "shared prompts" in why


@pytest.mark.parametrize(
    "requested,device,share,training,message",
    [
        ("flash", "cpu", False, False, "needs a CUDA device"),
        ("flash", "cuda", True, True, "cannot express shared prompts"),
        ("flex", "cpu", False, True, "cannot train on CPU"),
    ],
)
def test_refuses_what_cannot_run(monkeypatch, requested, device, share, training, message):
    monkeypatch.setattr(attn, "flash_attn_installed", lambda: True)
    with pytest.raises(ValueError, match=message):
        select_attention(requested, device, share, training, 512)


def test_flex_serves_forward_only_work_on_cpu():
    b, _ = select_attention("flex", "cpu", False, training=False, max_tokens=512)
    assert b.name == "flex"
