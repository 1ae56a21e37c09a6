"""Per-token log-probs (and entropy) without materialising the fp32 [T, V] log-softmax.

In: logits [T, V], or hidden states [T, H] plus the LM head weight [V, H]; targets [T].
Out: log p(target) [T] at the given temperature, optionally the entropy [T]; maths in fp32
(fp64 for fp64 inputs), whatever the model dtype.

Both functions work over chunks of `chunk_size` positions, so only [chunk_size, V] buffers
ever exist besides the inputs:
- `logprobs_from_hidden` (what the trainer uses) applies the LM head per chunk inside a
  custom autograd Function: forward keeps only the log-sum-exp [T]; backward recomputes each
  chunk's logits and writes d(loss)/d(logits) in place (about two [C, V] fp32 buffers), then
  multiplies it into the hidden and weight gradients. Full logits never exist.
- `logprobs_from_logits` takes logits a model already built; each chunk is cast to fp32
  under `torch.utils.checkpoint`, so the fp32 copies exist one chunk at a time.
bench/chunked_logprobs_memory.py measures the difference. Targets at ignored positions
(-100) must be replaced by a valid id (e.g. `labels.clamp(min=0)`) and masked by the caller.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from async_grpo.core.packing import PackedBatch, packed_hidden


def _chunk_stats(
    logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor]:
    """Log-prob of `targets` and entropy for one chunk; logits [C, V] in any dtype, maths in
    fp32 at least (fp64 inputs stay fp64)."""
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # [C, V]
    lse = torch.logsumexp(scaled, dim=-1)  # [C]
    logp = scaled.gather(-1, targets[:, None]).squeeze(-1) - lse  # [C]
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    probs = torch.softmax(scaled, dim=-1)  # [C, V]
    entropy = lse - (probs * scaled).sum(-1)  # [C]
    return logp, entropy


def _scaled_logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """A fresh fp32-or-wider logits buffer [C, V] for one chunk, divided by the temperature."""
    logits = hidden @ weight.T  # [C, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # [C, V]
    return logits.div_(temperature) if temperature != 1.0 else logits


class _HiddenLogprobs(torch.autograd.Function):
    """log p(targets) and entropy from hidden [T, H] and weight [V, H], chunk by chunk.

    d logp_t / d x_tv = onehot_tv - p_tv;  d H_t / d x_tv = -p_tv * (log p_tv + H_t),
    for x = logits / temperature; the chain rule then divides by the temperature."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy):
        logps, ents, lses = [], [], []
        for s in range(0, targets.numel(), chunk_size):
            x = _scaled_logits(hidden[s : s + chunk_size], weight, temperature)  # [C, V]
            lse = torch.logsumexp(x, dim=-1)  # [C]
            logps.append(x.gather(-1, targets[s : s + chunk_size, None])[:, 0] - lse)  # [C]
            lses.append(lse)
            if with_entropy:
                x -= lse[:, None]  # log-probs, in place
                ents.append(-(x.exp() * x).sum(-1))  # [C]
        logp = torch.cat(logps)  # [T]
        ent = torch.cat(ents) if with_entropy else torch.zeros_like(logp)  # [T]
        ctx.save_for_backward(hidden, weight, targets, torch.cat(lses), ent)
        ctx.config = (temperature, chunk_size, with_entropy)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        temperature, chunk_size, with_entropy = ctx.config
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None  # [T, H]
        acc = torch.promote_types(weight.dtype, torch.float32)
        need_w = ctx.needs_input_grad[1]
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        for s in range(0, targets.numel(), chunk_size):
            e = s + chunk_size
            h = hidden[s:e]  # [C, H]
            lp = _scaled_logits(h, weight, temperature).sub_(lse[s:e, None])  # [C, V]
            p = lp.exp()  # [C, V]
            if with_entropy:
                lp.add_(ent[s:e, None]).mul_(p).mul_(-g_ent[s:e, None])  # dH part, in place
                p.mul_(-g_logp[s:e, None]).add_(lp)  # [C, V]
            else:
                p.mul_(-g_logp[s:e, None])  # [C, V]
            del lp
            p.scatter_add_(-1, targets[s:e, None], g_logp[s:e, None])  # + onehot * g_logp
            if temperature != 1.0:
                p.div_(temperature)
            g = p.to(weight.dtype)  # [C, V] d loss / d logits
            if grad_h is not None:
                grad_h[s:e] = g @ weight  # [C, H]
            if grad_w is not None:
                grad_w += (g.T @ h).to(acc)  # [V, H]
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None


def logprobs_from_logits(
    logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(log p(targets) [T], entropy [T] or None) from logits [T, V], chunked over T; each
    chunk runs under checkpoint when a gradient is needed."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    grad = torch.is_grad_enabled() and logits.requires_grad
    logps, ents = [logits.new_zeros(0, dtype=torch.float32)], [logits.new_zeros(0)]
    for s in range(0, targets.numel(), chunk_size):
        args = (logits[s : s + chunk_size], targets[s : s + chunk_size], temperature, with_entropy)
        logp, ent = (
            checkpoint(_chunk_stats, *args, use_reentrant=False) if grad else _chunk_stats(*args)
        )
        logps.append(logp)  # [C]
        ents.append(ent)  # [C]
    logp = torch.cat(logps)  # [T]
    return logp, (torch.cat(ents).to(logp.dtype) if with_entropy else None)


def logprobs_from_hidden(
    hidden: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(log p(targets) [T], entropy [T] or None) from hidden [T, H] and weight [V, H];
    logits are built per chunk only, in the forward and again in the backward."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if targets.numel() == 0:
        empty = hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
        return empty, (empty if with_entropy else None)  # [0]
    logp, ent = _HiddenLogprobs.apply(
        hidden, lm_head_weight, targets, temperature, chunk_size, with_entropy
    )
    return logp, (ent if with_entropy else None)


def batch_logprobs(
    model: nn.Module,
    batch: PackedBatch,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    attention: Any = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs [T] (0 off `batch.loss_mask`) of a Hugging Face causal LM on a packed batch,
    via `model.model` hidden states and the chunked LM head (models whose head is a bias-free
    linear layer, as in Llama/SmolLM2; no logit soft-capping). `attention` is the model's
    `AttentionBackend` (None: dense SDPA); `batch` must already be `attention.prepare`d."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}: LM head has a bias; not supported")
    hidden = packed_hidden(model, batch, attention)  # [T, H]
    targets = batch.labels[0].clamp(min=0)  # [T]
    logp, ent = logprobs_from_hidden(
        hidden, head.weight, targets, temperature, chunk_size, with_entropy
    )
    mask = batch.loss_mask  # [T]
    logp = logp * mask  # [T]
    return logp, (ent * mask if ent is not None else None)
