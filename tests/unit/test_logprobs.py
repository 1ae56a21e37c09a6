"""Chunked log-probs and entropy equal the plain full-vocabulary computation, gradients too."""

from __future__ import annotations

import pytest
import torch

from async_grpo.core.logprobs import (
    HeadTransform,
    head_transform,
    logprobs_from_hidden,
    logprobs_from_logits,
)

T, H, V = 37, 16, 1000


def _reference(logits, targets, temperature, chunk_size=None, with_entropy=True):
    """Plain full-vocabulary log-softmax in float64."""
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)  # [T, V]
    logp = logp_all.gather(-1, targets[:, None])[:, 0]  # [T]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [T]
    return logp, entropy


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g)  # [T, H]
    weight = torch.randn(V, H, generator=g) * 0.5  # [V, H]
    targets = torch.randint(0, V, (T,), generator=g)  # [T]
    c_logp = torch.randn(T, generator=g)  # [T] upstream gradients
    c_ent = torch.randn(T, generator=g)  # [T]
    return hidden, weight, targets, c_logp, c_ent


def _run(fn, leaves, *args, chunk_size, c_logp, c_ent):
    """Values and the gradients of sum(c_logp * logp + c_ent * entropy) wrt `leaves`."""
    for leaf in leaves:
        leaf.grad = None
    logp, ent = fn(*args, chunk_size=chunk_size, with_entropy=True)
    (logp * c_logp + ent * c_ent).sum().backward()
    return [logp.detach(), ent.detach()] + [leaf.grad.clone() for leaf in leaves]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logits_match_unchunked(temperature):
    hidden, weight, targets, c_logp, c_ent = _inputs()
    logits = (hidden @ weight.T).requires_grad_()  # [T, V]
    kw = dict(c_logp=c_logp, c_ent=c_ent)
    args = (logits, targets, temperature)
    whole = _run(logprobs_from_logits, [logits], *args, chunk_size=10**9, **kw)
    for chunk_size in (1, 8, 37, 100):
        chunked = _run(logprobs_from_logits, [logits], *args, chunk_size=chunk_size, **kw)
        assert _max_diff(chunked, whole) <= 1e-6, chunk_size
    # and the unchunked path is right: an independent float64 computation
    ref = _run(_reference, [logits], *args, chunk_size=None, **kw)
    assert _max_diff(whole, ref) <= 1e-5


@pytest.mark.parametrize(
    "dtype, rtol, atol", [(torch.float64, 0.0, 1e-6), (torch.float32, 1.3e-6, 1e-5)]
)
def test_chunked_hidden_matches_unchunked(dtype, rtol, atol):
    """fp64 checks the chunking itself at 1e-6. In fp32 a per-chunk matmul rounds differently
    from the whole one (log-probs of magnitude ~16 and weight gradients of ~7 move by a few
    ulp, ~1e-5), so fp32 uses torch's default fp32 tolerances (atol 1e-5, rtol 1.3e-6);
    a chunking error would be off by orders of magnitude more."""
    hidden, weight, targets, c_logp, c_ent = _inputs(1)
    hidden = hidden.to(dtype).requires_grad_()  # [T, H]
    weight = weight.to(dtype).requires_grad_()  # [V, H]
    kw = dict(c_logp=c_logp.to(dtype), c_ent=c_ent.to(dtype))
    args = (hidden, weight, targets, 0.7)
    whole = _run(logprobs_from_hidden, [hidden, weight], *args, chunk_size=10**9, **kw)
    for chunk_size in (1, 8, 100):
        chunked = _run(logprobs_from_hidden, [hidden, weight], *args, chunk_size=chunk_size, **kw)
        for got, want in zip(chunked, whole, strict=True):
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)

    def full(hidden, weight, targets, temperature, chunk_size, with_entropy):
        return _reference(hidden @ weight.T, targets, temperature)

    ref = _run(full, [hidden, weight], *args, chunk_size=None, **kw)
    assert _max_diff(whole, ref) <= 1e-5


def test_hidden_without_entropy_and_frozen_head():
    hidden, weight, targets, c_logp, _ = _inputs(3)
    hidden = hidden.double().requires_grad_()  # [T, H]
    weight = weight.double()  # [V, H], frozen
    logp, ent = logprobs_from_hidden(hidden, weight, targets, 1.3, chunk_size=6)
    (logp * c_logp.double()).sum().backward()
    got = hidden.grad.clone()
    hidden.grad = None
    want, _ = _reference(hidden @ weight.T, targets, 1.3)
    (want * c_logp.double()).sum().backward()
    assert ent is None and (logp - want).abs().max().item() <= 1e-6
    assert (got - hidden.grad).abs().max().item() <= 1e-6


def test_no_grad_path_bf16_input_and_no_entropy():
    hidden, weight, targets, _, _ = _inputs(2)
    logits = (hidden @ weight.T).bfloat16()  # [T, V]
    with torch.no_grad():
        logp, ent = logprobs_from_logits(logits, targets, chunk_size=5)
    want, _ = _reference(logits, targets, 1.0)  # float64 maths on the bf16 values
    assert ent is None and logp.dtype == torch.float32
    assert (logp - want).abs().max().item() <= 1e-5
    empty, _ = logprobs_from_hidden(hidden[:0], weight, targets[:0])
    assert empty.shape == (0,)
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        logprobs_from_logits(logits, targets, chunk_size=0)


def test_fused_head_equals_the_eager_one():
    """The compiled per-chunk maths (the trainer's head on CUDA, compiled here for the CPU)
    gives the eager head's log-probs, entropy and gradients, with a short last chunk, with
    and without entropy."""
    hidden, weight, targets, c_logp, c_ent = _inputs(4)
    hidden, weight = hidden.requires_grad_(), weight.requires_grad_()
    kw = dict(c_logp=c_logp, c_ent=c_ent)

    def fused(*args, **kwargs):
        return logprobs_from_hidden(*args, **kwargs, fused=True)

    args = (hidden, weight, targets, 0.7)
    eager = _run(logprobs_from_hidden, [hidden, weight], *args, chunk_size=16, **kw)
    got = _run(fused, [hidden, weight], *args, chunk_size=16, **kw)  # chunks 16, 16, 5
    for a, b in zip(got, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1.3e-6, atol=1e-5)
    hidden.grad = None
    logp, ent = fused(hidden, weight, targets, 1.0, chunk_size=16, with_entropy=False)
    (logp * c_logp).sum().backward()
    want, _ = _reference(hidden @ weight.T, targets, 1.0)
    assert ent is None and (logp.double() - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "head",
    [HeadTransform(softcap=3.0), HeadTransform(scale=0.25), HeadTransform(scale=2.0, softcap=5.0)],
    ids=["softcap", "scale", "both"],
)
@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_head_transform_values_and_gradients(head, fused):
    """A family's soft-capping and scaling (vLLM's order: cap, then scale, then the
    temperature) give the log-probs, entropy and gradients of the plain computation on the
    transformed logits, in float64 (eager and compiled chunk maths)."""
    hidden, weight, targets, c_logp, c_ent = _inputs(5)
    hidden = hidden.double().requires_grad_()  # [T, H]
    weight = weight.double().requires_grad_()  # [V, H]
    kw = dict(c_logp=c_logp.double(), c_ent=c_ent.double())

    def ours(*args, **kwargs):
        return logprobs_from_hidden(*args, **kwargs, fused=fused, head=head)

    def plain(hidden, weight, targets, temperature, chunk_size, with_entropy):
        logits = hidden @ weight.T  # [T, V]
        if head.softcap:
            logits = torch.tanh(logits / head.softcap) * head.softcap
        return _reference(logits * head.scale, targets, temperature)

    args = (hidden, weight, targets, 0.7)
    got = _run(ours, [hidden, weight], *args, chunk_size=8, **kw)
    want = _run(plain, [hidden, weight], *args, chunk_size=None, **kw)
    assert _max_diff(got, want) <= 1e-9
    untransformed = _run(logprobs_from_hidden, [hidden, weight], *args, chunk_size=8, **kw)
    assert _max_diff(untransformed, want) > 1e-2  # the transform changes the answer


def test_head_transform_from_the_config():
    from types import SimpleNamespace as Config

    assert head_transform(Config()).identity
    assert head_transform(Config(final_logit_softcapping=30.0)) == HeadTransform(1.0, 30.0)
    assert head_transform(Config(logits_scaling=4.0)) == HeadTransform(0.25)  # Granite
    assert head_transform(Config(logit_scale=0.0625)) == HeadTransform(0.0625)  # Cohere


def test_a_head_bias_enters_the_logits_and_gets_its_gradient():
    """An LM head with a bias (Phi-2): chunked log-probs and entropy, and the gradients of
    hidden, weight and bias, equal autograd through the whole `hidden @ W.T + b` (fp64)."""
    hidden, weight, targets, c_logp, c_ent = _inputs(4)
    hidden = hidden.double().requires_grad_()  # [T, H]
    weight = weight.double().requires_grad_()  # [V, H]
    bias = torch.randn(weight.shape[0], dtype=torch.float64, requires_grad=True)  # [V]
    logp, ent = logprobs_from_hidden(
        hidden, weight, targets, 0.8, chunk_size=5, with_entropy=True, bias=bias
    )
    (logp * c_logp.double() + ent * c_ent.double()).sum().backward()
    got = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    want, want_ent = _reference(hidden @ weight.T + bias, targets, 0.8)
    (want * c_logp.double() + want_ent * c_ent.double()).sum().backward()
    assert (logp - want).abs().max().item() <= 1e-9
    assert (ent - want_ent).abs().max().item() <= 1e-9
    for g, t in zip(got, (hidden, weight, bias), strict=True):
        torch.testing.assert_close(g, t.grad, rtol=0, atol=1e-9)
    assert bias.grad.abs().max().item() > 1e-3  # the bias does move
