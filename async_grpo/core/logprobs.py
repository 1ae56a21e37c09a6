"""Per-token log-probs (and entropy) without materialising the fp32 [T, V] log-softmax.

In: logits [T, V], or hidden states [T, H] plus the LM head weight [V, H]; targets [T].
Out: log p(target) [T] at the given temperature, optionally the entropy [T]; maths in fp32
(fp64 for fp64 inputs), whatever the model dtype.

Both functions work over chunks of `chunk_size` positions, so only [chunk_size, V] buffers
ever exist besides the inputs:
- `logprobs_from_hidden` (what the trainer uses) applies the LM head per chunk inside a
  custom autograd Function: forward keeps only the log-sum-exp [T]; backward recomputes each
  chunk's logits and writes d(loss)/d(logits) in place (about two [C, V] fp32 buffers), then
  multiplies it into the hidden and weight gradients. Full logits never exist. With
  `fused` (the trainer's choice for trainer.kernels liger/compile) each chunk's maths is one
  compiled kernel per direction instead of several fp32 passes (docs/gpu-kernels.md).
- `logprobs_from_logits` takes logits a model already built; each chunk is cast to fp32
  under `torch.utils.checkpoint`, so the fp32 copies exist one chunk at a time.
bench/chunked_logprobs_memory.py measures the difference. Targets at ignored positions
(-100) must be replaced by a valid id (e.g. `labels.clamp(min=0)`) and masked by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from async_grpo.core.attention import DenseAttention
from async_grpo.core.model_parts import decoder, output_head
from async_grpo.core.packing import PackedBatch


@dataclass(frozen=True)
class HeadTransform:
    """What a family does to the LM head's output before sampling, in vLLM's order:
    `softcap * tanh(logits / softcap)` (Gemma-2's final soft-capping), then `* scale`
    (Granite divides by `logits_scaling`, Cohere multiplies by `logit_scale`). The
    temperature divides after it."""

    scale: float = 1.0
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and not self.softcap

    def apply(self, logits: Tensor) -> Tensor:
        """[C, V] -> [C, V]; a fresh tensor, so in-place chunk maths may follow."""
        z = logits
        if self.softcap:
            z = torch.tanh(z / self.softcap).mul_(self.softcap)
        return z * self.scale if self.scale != 1.0 else z

    def backward(self, z: Tensor, grad_z: Tensor) -> Tensor:
        """d loss / d logits from d loss / d z, z = apply(logits) [C, V]; in place."""
        if self.softcap:
            t = z / (self.scale * self.softcap)  # tanh(logits / softcap)  [C, V]
            grad_z.mul_(1.0 - t * t)
        return grad_z.mul_(self.scale) if self.scale != 1.0 else grad_z


def packed_forward(model: nn.Module, batch: PackedBatch, attention: Any = None) -> Tensor:
    """Logits [T, V] of a Hugging Face causal LM on a packed row (see the module docstring).
    `attention` is an `AttentionBackend` (core/attention); None: dense SDPA's rule."""
    out = model(use_cache=False, **_model_inputs(model, batch, attention))
    return out.logits[0]  # [T, V]


def packed_hidden(model: nn.Module, batch: PackedBatch, attention: Any = None) -> Tensor:
    """Last hidden states [T, H] (after the final norm) of the model's decoder (its LM head
    left out, `model_parts.decoder`); pair with `logprobs_from_hidden` so full logits are
    never built."""
    out = decoder(model)(use_cache=False, **_model_inputs(model, batch, attention))
    return out.last_hidden_state[0]  # [T, H]


def _model_inputs(model: nn.Module, batch: PackedBatch, attention: Any) -> dict[str, Any]:
    inputs: dict[str, Any] = {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
    if attention is None:
        attention = DenseAttention()
    mask = attention.mask(batch, next(model.parameters()).dtype, model.config)
    if mask is not None:
        inputs["attention_mask"] = mask
    return inputs


def head_transform(config: Any) -> HeadTransform:
    """The `HeadTransform` a Hugging Face config asks for (identity for most families)."""
    scale = 1.0
    if getattr(config, "logits_scaling", None):
        scale /= float(config.logits_scaling)
    if getattr(config, "logit_scale", None):
        scale *= float(config.logit_scale)
    return HeadTransform(scale, getattr(config, "final_logit_softcapping", None) or None)


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


def _fused_stats(logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool):
    """(log p(target), lse, entropy or zeros) [C] of one chunk of logits [C, V], written to be
    compiled: one pass over the logits, no [C, V] temporaries in fp32."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # [C, V]
    lse = torch.logsumexp(x, dim=-1)  # [C]
    logp = x.gather(-1, targets[:, None])[:, 0] - lse  # [C]
    if not with_entropy:
        return logp, lse, torch.zeros_like(lse)
    lp = x - lse[:, None]  # [C, V] log-probs
    return logp, lse, -(lp.exp() * lp).sum(-1)  # [C]


def _fused_grad(logits, targets, lse, ent, g_logp, g_ent, temperature: float, with_entropy: bool):
    """d(loss)/d(logits) [C, V] in the logits' dtype for one chunk (the eager backward's
    maths, written to be compiled into one kernel)."""
    wide = torch.promote_types(logits.dtype, torch.float32)
    lp = logits.to(wide) / temperature - lse[:, None]  # [C, V] log-probs
    p = lp.exp()  # [C, V]
    g = -g_logp[:, None] * p
    if with_entropy:
        g = g - g_ent[:, None] * p * (lp + ent[:, None])
    vocab = torch.arange(logits.shape[-1], device=logits.device)  # [V]
    g = g + (vocab[None, :] == targets[:, None]) * g_logp[:, None]  # + onehot * g_logp
    return (g / temperature).to(logits.dtype)


_fused: dict[str, Any] = {}


def _fused_fns() -> tuple[Any, Any]:
    """The two chunk functions compiled once per process (shapes: the chunk size, and the
    last chunk's, which become dynamic after the first recompile)."""
    if not _fused:
        _fused["stats"] = torch.compile(_fused_stats)
        _fused["grad"] = torch.compile(_fused_grad)
    return _fused["stats"], _fused["grad"]


def _eager_stats(logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool):
    """`_fused_stats` in place: `logits` is the chunk's fresh matmul output, overwritten
    when it is already fp32 or wider (else one widened copy is)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # [C, V] fresh
    x = x.div_(temperature) if temperature != 1.0 else x
    lse = torch.logsumexp(x, dim=-1)  # [C]
    logp = x.gather(-1, targets[:, None])[:, 0] - lse  # [C]
    if not with_entropy:
        return logp, lse, torch.zeros_like(lse)
    x -= lse[:, None]  # log-probs, in place
    return logp, lse, -(x.exp() * x).sum(-1)  # [C]


def _eager_grad(logits, targets, lse, ent, g_logp, g_ent, temperature: float, with_entropy: bool):
    """`_fused_grad` in place, on fresh `logits` as `_eager_stats`: about two [C, V] fp32
    buffers."""
    lp = logits.to(torch.promote_types(logits.dtype, torch.float32))  # [C, V] fresh
    lp = lp.div_(temperature) if temperature != 1.0 else lp
    lp.sub_(lse[:, None])  # log-probs
    p = lp.exp()  # [C, V]
    if with_entropy:
        lp.add_(ent[:, None]).mul_(p).mul_(-g_ent[:, None])  # dH part, in place
        p.mul_(-g_logp[:, None]).add_(lp)  # [C, V]
    else:
        p.mul_(-g_logp[:, None])  # [C, V]
    del lp
    p.scatter_add_(-1, targets[:, None], g_logp[:, None])  # + onehot * g_logp
    if temperature != 1.0:
        p.div_(temperature)
    return p.to(logits.dtype)  # [C, V] d loss / d logits


class _HiddenLogprobs(torch.autograd.Function):
    """log p(targets) and entropy from hidden [T, H] and weight [V, H], chunk by chunk; each
    chunk's maths eager and in place, or `fused` (compiled).

    d logp_t / d x_tv = onehot_tv - p_tv;  d H_t / d x_tv = -p_tv * (log p_tv + H_t),
    for x = logits / temperature; the chain rule then divides by the temperature."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, temperature, chunk_size, with_entropy, fused, head
    ):
        stats = _fused_fns()[0] if fused else _eager_stats
        logps, ents, lses = [], [], []
        for s in range(0, targets.numel(), chunk_size):
            logits = head.apply(_linear(hidden[s : s + chunk_size], weight, bias))  # [C, V]
            logp, lse, ent = stats(logits, targets[s : s + chunk_size], temperature, with_entropy)
            logps.append(logp)
            lses.append(lse)
            ents.append(ent)
        logp, ent = torch.cat(logps), torch.cat(ents)  # [T]
        ctx.save_for_backward(hidden, weight, bias, targets, torch.cat(lses), ent)
        ctx.config = (temperature, chunk_size, with_entropy, fused, head)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        temperature, chunk_size, with_entropy, fused, head = ctx.config
        grad_fn = _fused_fns()[1] if fused else _eager_grad
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None  # [T, H]
        acc = torch.promote_types(weight.dtype, torch.float32)
        need_w = ctx.needs_input_grad[1]
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        need_b = bias is not None and ctx.needs_input_grad[2]
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        for s in range(0, targets.numel(), chunk_size):
            e = s + chunk_size
            h = hidden[s:e]  # [C, H]
            z = head.apply(_linear(h, weight, bias))  # [C, V]
            g = grad_fn(
                z if head.identity else z.clone(),  # the eager maths overwrite their input
                targets[s:e],
                lse[s:e],
                ent[s:e],
                g_logp[s:e],
                g_ent[s:e],
                temperature,
                with_entropy,
            )  # fmt: skip  [C, V] d loss / d z
            g = g if head.identity else head.backward(z, g)  # d loss / d logits
            if grad_h is not None:
                grad_h[s:e] = g @ weight  # [C, H]
            if grad_w is not None:
                grad_w += (g.T @ h).to(acc)  # [V, H]
            if grad_b is not None:
                grad_b += g.sum(0).to(acc)  # [V]
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def _linear(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The LM head on a chunk: h [C, H] @ weight [V, H].T (+ bias [V]) -> [C, V]."""
    return h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)


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
    fused: bool = False,
    head: HeadTransform = HeadTransform(),
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(log p(targets) [T], entropy [T] or None) from hidden [T, H], weight [V, H] and the
    head's `bias` [V] if it has one (Phi-2, GPT-J);
    logits are built per chunk only, in the forward and again in the backward, and go
    through the family's `head` transform. `fused`: the per-chunk maths runs as compiled
    kernels (one read of each chunk's logits), the trainer's choice on CUDA; otherwise
    eager, in place."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if targets.numel() == 0:
        empty = hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
        return empty, (empty if with_entropy else None)  # [0]
    logp, ent = _HiddenLogprobs.apply(
        hidden, lm_head_weight, bias, targets, temperature, chunk_size, with_entropy, fused, head
    )
    return logp, (ent if with_entropy else None)


def batch_logprobs(
    model: nn.Module,
    batch: PackedBatch,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    attention: Any = None,
    fused_head: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs [T] (0 off `batch.loss_mask`) of a Hugging Face causal LM on a packed batch,
    via the decoder's hidden states and the chunked LM head (a linear layer, with its bias
    where it has one; the family's soft-capping or scaling after it, `head_transform`). `attention` is the model's
    `AttentionBackend` (None: dense SDPA); `batch` must already be `attention.prepare`d."""
    head = output_head(model)
    hidden = packed_hidden(model, batch, attention)  # [T, H]
    targets = batch.labels[0].clamp(min=0)  # [T]
    logp, ent = logprobs_from_hidden(
        hidden, head.weight, targets, temperature, chunk_size, with_entropy, fused_head,
        head_transform(model.config), getattr(head, "bias", None),
    )  # fmt: skip
    mask = batch.loss_mask  # [T]
    logp = logp * mask  # [T]
    return logp, (ent * mask if ent is not None else None)
