"""The GRPO loss family, from per-token log-probs to one scalar per minibatch.

In: current-policy log-probs [T] (with grad), a `PackedBatch`, optional entropy [T], and the
GLOBAL counts of the optimizer step. Out: the loss scalar and summed metrics.

Per loss token t of sample s, with old = old_logprobs if given, else the trainer's own
log-probs before this step's update (detached) when `proximal="current"` (the default),
else the sampler's behaviour_logprobs:
    pg_t    = the objective's policy term (core/objectives.py: ppo, gspo, cispo, gmpo, sapo)
    corr_t  = the off-policy correction's weight from old vs behaviour, detached
              (core/correction.py: token or sequence level, truncated or masked)
              (gmpo: the sample's geometric mean of its tokens' weights, on each token)
    l_t     = corr_t * pg_t + kl_coef * k(logp_t, ref_t) - entropy_coef * H_t
k1 = logp - ref, k2 = (logp - ref)^2 / 2, k3 = exp(ref - logp) - (ref - logp) - 1.

`proximal="current"` is decoupled PPO (the proximal policy is the trainer's at the start
of the step). The trainer makes one optimizer update per step, so that policy is the
weights every minibatch's forward already runs under: old_t = logp_t.detach(), every
objective's ratio is exactly 1 in value (its gradient is that of logp_t), and the
correction's weight exp(logp_t - behaviour_t) is what corrects for the samples' staleness
and for the engine's numerics, at no extra forward. With "behaviour" (old = behaviour) the
weight is 1 and the objective's clip acts against the sampler's policy instead.

Mismatch metrics on every loss token, whatever `proximal`: |logp_t - behaviour_t| and the
k3 estimate of KL(behaviour || trainer) on the sampled tokens, exp(d) - 1 - d with
d = logp_t - behaviour_t.

Exact global normalisation. The step's objective is L = sum_t w_t * l_t over every loss
token of every minibatch on every rank, with w_t = 1 / N_tok ("token_mean"),
1 / (n_s * N_seq) ("seq_mean_token_mean", n_s = loss tokens of sample s) or
1 / (N_seq * C) ("seq_sum_constant", Dr.GRPO), where N_tok / N_seq are the GLOBAL counts
(`global_tokens`, `global_samples`, from `loss_counts` summed over minibatches and
all-reduced). Each minibatch returns W * sum_{t in minibatch} w_t * l_t, with W the number of
ranks the gradient reduction averages over (FSDP/DDP: world size; 1 for a SUM reduction), so
    grad = (1 / W) * sum_ranks sum_minibatches d(W * sum_t w_t l_t)/dtheta = dL/dtheta,
whatever the split of samples into ranks and minibatches (tests/unit/test_global_norm.py).

mask_truncated: tokens of truncated samples get weight 0 and are left out of both counts
(`loss_counts`), so the remaining samples are normalised as if the truncated ones were never
drawn. A sample with no weighted token counts in neither denominator.

Metrics are sums over weighted tokens (detached 0-d tensors): add them over minibatches and
ranks (all-reduce SUM), then `summarize_metrics` turns them into means and fractions; the
`*_max` ones are maxima (reduce them by max).
This module never touches torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from async_grpo.config import LossConfig
from async_grpo.core.correction import Correction
from async_grpo.core.objectives import DEFAULTS, OBJECTIVES, Bounds, Objective, per_sample_mean
from async_grpo.core.packing import PackedBatch

# ---- per-token terms --------------------------------------------------------------------


def kl_k1(logp: Tensor, ref: Tensor) -> Tensor:
    return logp - ref  # [T]


def kl_k2(logp: Tensor, ref: Tensor) -> Tensor:
    return 0.5 * (logp - ref) ** 2  # [T]


def kl_k3(logp: Tensor, ref: Tensor) -> Tensor:
    d = ref - logp  # [T]
    return torch.exp(d) - d - 1.0  # [T]


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}

# ---- aggregation: a weight per token, so the minibatch loss is sum_t w_t * l_t ----------

Aggregation = Callable[[Tensor, Tensor, int, int, float], Tensor]


def token_mean(mask: Tensor, sample_index: Tensor, tokens: int, samples: int, c: float) -> Tensor:
    return mask / max(tokens, 1)  # [T]


def seq_mean_token_mean(
    mask: Tensor, sample_index: Tensor, tokens: int, samples: int, c: float
) -> Tensor:
    per_sample = torch.bincount(sample_index, weights=mask)  # [N] loss tokens per sample
    n = per_sample[sample_index].clamp(min=1.0)  # [T]
    return mask / n / max(samples, 1)  # [T]


def seq_sum_constant(
    mask: Tensor, sample_index: Tensor, tokens: int, samples: int, c: float
) -> Tensor:
    return mask / (max(samples, 1) * c)  # [T]


AGGREGATIONS: dict[str, Aggregation] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_sum_constant": seq_sum_constant,
}

# ---- composition --------------------------------------------------------------------------


def loss_weight_mask(batch: PackedBatch, mask_truncated: bool) -> Tensor:
    """Tokens that carry loss [T] bool: completion targets, minus truncated samples if asked."""
    return batch.loss_mask & ~batch.truncated if mask_truncated else batch.loss_mask


def loss_counts(batch: PackedBatch, mask_truncated: bool) -> tuple[int, int]:
    """(loss tokens, samples with at least one loss token) of one minibatch; sum these over
    the step's minibatches and ranks to get `global_tokens`, `global_samples`."""
    mask = loss_weight_mask(batch, mask_truncated)  # [T]
    samples = batch.sample_index[mask].unique().numel()
    return int(mask.sum()), samples


def resolved(cfg: LossConfig) -> LossConfig:
    """`cfg` with what it leaves open (None) set to its objective's own (objectives.DEFAULTS):
    the ratio bounds and the aggregation."""
    own = DEFAULTS[cfg.objective]
    return replace(cfg, **{k: v for k, v in own.items() if getattr(cfg, k) is None})


@dataclass(frozen=True)
class GRPOLoss:
    """The configured loss; see the module docstring for the formula."""

    objective: Objective
    bounds: Bounds
    correction: Correction
    kl_coef: float
    kl_estimator: Callable[[Tensor, Tensor], Tensor]
    entropy_coef: float
    aggregation: Aggregation
    aggregation_name: str
    constant_normalizer: float
    mask_truncated: bool
    proximal: str = "current"
    geometric_weights: bool = False  # gmpo: one correction weight per sample, see below

    def __call__(
        self,
        logprobs: Tensor,
        batch: PackedBatch,
        global_tokens: int,
        global_samples: int,
        entropy: Tensor | None = None,
        world_size: int = 1,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss of one minibatch (scaled for exact global normalisation) and metric sums
        (`*_max` keys: maxima, to be reduced by max). `world_size`: ranks the gradient
        reduction averages over; 1 if it sums."""
        mask = loss_weight_mask(batch, self.mask_truncated)  # [T] bool
        behaviour = batch.behaviour_logprobs  # [T]
        current = logprobs.detach().masked_fill(~mask, 0.0)  # [T]
        if batch.old_logprobs is not None:
            old = batch.old_logprobs  # [T]
        elif self.proximal == "current":
            old = current  # [T]
        else:
            old = behaviour  # [T]
        adv, where = batch.advantages, batch.sample_index  # [T], [T]
        # off-mask positions are zeroed first, so junk there can neither overflow nor leak grad
        logp = logprobs.masked_fill(~mask, 0.0)  # [T]
        pg, m = self.objective(logp, old.masked_fill(~mask, 0.0), adv, mask, where, self.bounds)
        corr, corr_sums = self.correction(old, behaviour, current, adv, mask, where)  # [T]
        if self.geometric_weights:
            corr = per_sample_geometric_mean(corr, mask, where)  # [T]
        per_token = corr * pg  # [T]
        m = {"tokens": mask.sum(), **m, **corr_sums}
        d = (current - behaviour).masked_fill(~mask, 0.0)  # [T] trainer - sampler
        m["mismatch_abs_sum"] = d.abs()[mask].sum()
        k3 = torch.exp(d.clamp(max=50.0)) - 1.0 - d  # [T]; the clamp only keeps it finite
        m["mismatch_k3_sum"] = k3[mask].sum()
        if self.kl_coef:
            if batch.ref_logprobs is None:
                raise ValueError("kl_coef > 0 but the batch has no ref_logprobs")
            ref = batch.ref_logprobs.masked_fill(~mask, 0.0)  # [T]
            kl = self.kl_estimator(logp, ref)  # [T], 0 off-mask
            per_token = per_token + self.kl_coef * kl  # [T]
            m["kl_sum"] = kl[mask].sum()
        if entropy is not None:
            per_token = per_token - self.entropy_coef * entropy.masked_fill(~mask, 0.0)  # [T]
            m["entropy_sum"] = entropy[mask].sum()
        elif self.entropy_coef:
            raise ValueError("entropy_coef > 0 but no entropy was passed")
        weights = self.aggregation(
            mask.float(), where, global_tokens, global_samples, self.constant_normalizer
        )  # [T]
        loss = (per_token * weights).sum() * world_size
        return loss, {k: v.detach().float() for k, v in m.items()}


def per_sample_geometric_mean(w: Tensor, mask: Tensor, sample_index: Tensor) -> Tensor:
    """Each sample's geometric mean of the weights `w` [T] (detached, >= 0) over its loss
    tokens, at each of its positions [T]; 0 for a sample with a token of weight 0. GMPO's
    policy term is one value per sample, and verl's `geo_mean` weighs it by this mean of
    the token weights, as the ratio itself is a geometric mean; a per-token product would
    give their arithmetic mean instead."""
    zero = per_sample_mean((w == 0).to(w.dtype), mask, sample_index) > 0  # [T]
    log_w = torch.log(w.clamp(min=torch.finfo(w.dtype).tiny)).masked_fill(~mask, 0.0)  # [T]
    geo = torch.exp(per_sample_mean(log_w, mask, sample_index))  # [T]
    return geo.masked_fill(zero | ~mask, 0.0)


def build_loss(cfg: LossConfig, max_new_tokens: int | None = None) -> GRPOLoss:
    """A `GRPOLoss` from config; `max_new_tokens` is the Dr.GRPO constant when
    `cfg.constant_normalizer` is None."""
    cfg = resolved(cfg)
    constant = cfg.constant_normalizer if cfg.constant_normalizer is not None else max_new_tokens
    if cfg.aggregation == "seq_sum_constant" and not constant:
        raise ValueError("seq_sum_constant: set loss.constant_normalizer or pass max_new_tokens")
    return GRPOLoss(
        objective=OBJECTIVES[cfg.objective],
        geometric_weights=cfg.objective == "gmpo",
        bounds=Bounds(
            cfg.clip_low,
            cfg.clip_high,
            cfg.dual_clip,
            cfg.cispo_cap,
            cfg.sapo_tau_pos,
            cfg.sapo_tau_neg,
        ),
        correction=Correction(cfg.correction),
        kl_coef=cfg.kl_coef,
        kl_estimator=KL_ESTIMATORS[cfg.kl_estimator],
        entropy_coef=cfg.entropy_coef,
        aggregation=AGGREGATIONS[cfg.aggregation],
        aggregation_name=cfg.aggregation,
        constant_normalizer=float(constant or 1.0),
        mask_truncated=cfg.mask_truncated,
        proximal=cfg.proximal,
    )


FRACTIONS = (
    "clip_low",
    "clip_high",
    "dual_clip",
    "is_truncated",
    "is_masked",
    "negative_masked",
)


def summarize_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Per-token means from metric sums added over minibatches and ranks: `x_sum` becomes
    `x_frac` for the counts of FRACTIONS, `x_mean` otherwise; `tokens` and the maxima
    (`x_max`, reduced by max) are kept."""
    tokens = float(sums.get("tokens", 0.0))
    out = {"tokens": tokens}
    for key, value in sums.items():
        if key.endswith("_max"):
            out[key] = float(value)
        elif key.endswith("_sum"):
            stem = key.removesuffix("_sum")
            out[stem + ("_frac" if stem in FRACTIONS else "_mean")] = float(value) / max(
                tokens, 1.0
            )
    return out
