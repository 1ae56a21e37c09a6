"""The policy term of each objective, per loss token: `pg_t` such that the step's loss is
sum_t w_t * corr_t * pg_t (w_t: the aggregation's weight, corr_t: the off-policy
correction's, both in core/loss.py).

In: log-probs with grad [T], the proximal policy's `old` [T] (detached), advantages [T], the
loss mask [T] and each position's sample [T]. A sample's tokens are all in one minibatch
(packing takes whole samples), so a per-sample sum over `sample_index` sees every token
of the sample. Out: pg [T] (0 off the mask) and the counts of tokens each bound acted on.

- ppo:   r_t = exp(logp_t - old_t); pg_t = max(-A r_t, -A clip(r_t, 1 - lo, 1 + hi)),
         then the dual clip min(pg_t, -c A) for A < 0.
- gspo:  s = exp(mean_t (logp_t - old_t)) over the sample's tokens (Zheng et al. 2025), in
         the token form whose value is s on every token and whose gradient is s * grad
         logp_t: s_t = exp(logp_t - sg(logp_t) + sg(log s)); pg_t as ppo's with s_t. With
         the per-sample mean (seq_mean_token_mean) the gradient is exactly grad s.
- cispo: pg_t = -A sg(min(r_t, cap)) exp(logp_t - sg(logp_t)): the value is -A times the
         capped weight, the gradient -A min(r_t, cap) grad logp_t for every token; a capped
         token keeps its gradient (MiniMax-M1). The cap is the weight's, not 1 + eps.
- gmpo:  the geometric mean of token ratios, each clipped in log space to [-lo, hi] on the
         pessimistic side: d_t = sgn(A) min(sgn(A) dl_t, sgn(A) clip(dl_t, -lo, hi)),
         dl_t = logp_t - old_t; g = exp(mean_t d_t); pg_t = -A g on every token of the sample.
- sapo:  a soft gate in place of the clip (Gao et al. 2025): pg_t = -A (4/tau) sigmoid(tau
         (r_t - 1)), tau = tau_pos for A > 0, tau_neg otherwise. At r_t = 1 its gradient is
         ppo's (-A grad logp_t); it fades smoothly as r_t leaves 1, faster for A < 0 when
         tau_neg > tau_pos. Nothing is clipped, so no clip counts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

MAX_LOG_RATIO = 20.0  # |log ratio| beyond this is clamped before exp: finite, same sign


@dataclass(frozen=True)
class Bounds:
    """The objective's parameters: ratio bounds (log-space for gmpo), dual clip, cispo cap,
    sapo's gate temperatures."""

    clip_low: float
    clip_high: float
    dual_clip: float | None
    cispo_cap: float
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05


Objective = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Bounds], tuple[Tensor, dict]]


def per_sample_mean(x: Tensor, mask: Tensor, sample_index: Tensor) -> Tensor:
    """The mean of `x` over each sample's loss tokens, at every position of the sample [T]
    (0 for a sample with no loss token); differentiable in `x`."""
    maskf = mask.to(x.dtype)
    n = int(sample_index.max()) + 1 if sample_index.numel() else 0
    sums = x.new_zeros(n).index_add(0, sample_index, x * maskf)  # [N]
    counts = maskf.new_zeros(n).index_add(0, sample_index, maskf).clamp(min=1.0)  # [N]
    return (sums / counts)[sample_index]  # [T]


def _clipped(ratio: Tensor, adv: Tensor, mask: Tensor, b: Bounds) -> tuple[Tensor, dict]:
    """PPO-clip of `ratio` [T] with the dual clip, and the tokens each bound cut off."""
    clipped = ratio.clamp(1.0 - b.clip_low, 1.0 + b.clip_high)  # [T]
    pg = torch.maximum(-adv * ratio, -adv * clipped)  # [T]
    low = (adv < 0) & (ratio < 1.0 - b.clip_low) & mask  # [T]
    high = (adv > 0) & (ratio > 1.0 + b.clip_high) & mask  # [T]
    counts = {"clip_low_sum": low.sum(), "clip_high_sum": high.sum()}
    if b.dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -b.dual_clip * adv), pg)  # [T]
        counts["dual_clip_sum"] = ((adv < 0) & (ratio > b.dual_clip) & mask).sum()
    return pg, counts


def ppo(logp, old, adv, mask, sample_index, b: Bounds) -> tuple[Tensor, dict]:
    log_ratio = (logp - old).masked_fill(~mask, 0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)  # [T]
    pg, counts = _clipped(ratio, adv, mask, b)
    return pg, counts | {"ratio_sum": ratio[mask].sum()}


def gspo(logp, old, adv, mask, sample_index, b: Bounds) -> tuple[Tensor, dict]:
    log_ratio = (logp - old).masked_fill(~mask, 0.0)  # [T]
    log_s = per_sample_mean(log_ratio.detach(), mask, sample_index)  # [T], per sample
    log_st = logp - logp.detach() + log_s.clamp(max=MAX_LOG_RATIO)
    ratio = torch.exp(log_st.masked_fill(~mask, 0.0))  # [T], value s of its sample
    pg, counts = _clipped(ratio, adv, mask, b)
    return pg, counts | {"ratio_sum": ratio.detach()[mask].sum()}


def cispo(logp, old, adv, mask, sample_index, b: Bounds) -> tuple[Tensor, dict]:
    log_ratio = (logp - old).detach().masked_fill(~mask, 0.0)  # [T]
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # [T]
    weight = ratio.clamp(max=b.cispo_cap)  # [T], detached
    unit = torch.exp((logp - logp.detach()).masked_fill(~mask, 0.0))  # [T], value 1
    pg = -adv * weight * unit  # [T]
    capped = (ratio > b.cispo_cap) & mask  # [T]
    return pg, {"ratio_sum": ratio[mask].sum(), "clip_high_sum": capped.sum()}


def gmpo(logp, old, adv, mask, sample_index, b: Bounds) -> tuple[Tensor, dict]:
    dl = (logp - old).masked_fill(~mask, 0.0)  # [T]
    sign = torch.sign(adv)  # [T]
    clipped = dl.clamp(-b.clip_low, b.clip_high)  # [T]
    d = sign * torch.minimum(sign * dl, sign * clipped)  # [T]; A = 0: 0, no term anyway
    g = torch.exp(per_sample_mean(d, mask, sample_index).clamp(max=MAX_LOG_RATIO))  # [T]
    pg = -adv * g  # [T], the sample's loss on each of its tokens
    low = (adv < 0) & (dl < -b.clip_low) & mask  # [T]
    high = (adv > 0) & (dl > b.clip_high) & mask  # [T]
    counts = {"clip_low_sum": low.sum(), "clip_high_sum": high.sum()}
    return pg, counts | {"ratio_sum": g.detach()[mask].sum()}


def sapo(logp, old, adv, mask, sample_index, b: Bounds) -> tuple[Tensor, dict]:
    log_ratio = (logp - old).masked_fill(~mask, 0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)  # [T]
    tau = torch.where(adv > 0, b.sapo_tau_pos, b.sapo_tau_neg).to(ratio.dtype)  # [T]
    pg = -adv * (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))  # [T]
    return pg, {"ratio_sum": ratio.detach()[mask].sum()}


OBJECTIVES: dict[str, Objective] = {
    "ppo": ppo,
    "gspo": gspo,
    "cispo": cispo,
    "gmpo": gmpo,
    "sapo": sapo,
}

# what an objective takes when the config leaves it open: its paper's ratio bounds (gmpo's
# in log space) and aggregation
DEFAULTS: dict[str, dict] = {
    "ppo": {"clip_low": 0.2, "clip_high": 0.28, "aggregation": "token_mean"},
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4, "aggregation": "seq_mean_token_mean"},
    "cispo": {"clip_low": 0.2, "clip_high": 0.28, "aggregation": "token_mean"},
    "gmpo": {"clip_low": 0.4, "clip_high": 0.4, "aggregation": "seq_mean_token_mean"},
    # no clip (the bounds are unused); the paper's and TRL's per-sequence mean
    "sapo": {"clip_low": 0.2, "clip_high": 0.28, "aggregation": "seq_mean_token_mean"},
}
