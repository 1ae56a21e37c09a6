"""The off-policy correction: one detached weight per loss token that multiplies its policy
term, for the gap between the policy the ratio is taken against (`old`: the proximal
policy) and the one that sampled the tokens (`behaviour`: vLLM, possibly stale, in its own
numerics). In an asynchronous run the same weight covers both causes.

    log w_t = old_t - behaviour_t                          level "token"
    log w_t = sum_{u in s} (old_u - behaviour_u)           level "sequence" (a product)
    log w_t = mean_{u in s} (old_u - behaviour_u)          level "geometric"
    truncate: w = min(w, cap)                              (TIS; verl rollout_is)
    mask:     w = w if floor <= w <= cap else 0            (IcePop / MIS; TRL *_mask)
    off:      w = 1

With `proximal: behaviour` old == behaviour and w == 1: the ratio itself is against the
sampler. Apart from it, `negative_threshold` (DeepSeek-V3.2's off-policy sequence masking)
gives weight 0 to a sample with A < 0 whose mean log(behaviour / current) over its tokens
exceeds the threshold: a bad sample the trainer has already moved away from is not pushed
down further. Masked tokens stay in the step's normaliser (it is counted before the
trainer's log-probs exist), as in TRL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from async_grpo.config import CorrectionConfig
from async_grpo.core.objectives import MAX_LOG_RATIO, per_sample_mean


@dataclass(frozen=True)
class Correction:
    """A `CorrectionConfig`, callable: the weights [T] and their metric sums."""

    cfg: CorrectionConfig

    def __call__(
        self,
        old: Tensor,
        behaviour: Tensor,
        current: Tensor,
        adv: Tensor,
        mask: Tensor,
        sample_index: Tensor,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """All of [T], detached; 0 off the mask."""
        c = self.cfg
        log_w = (old - behaviour).masked_fill(~mask, 0.0)  # [T]
        if c.level == "sequence":
            n = torch.bincount(sample_index, weights=mask.to(log_w.dtype))  # [N]
            log_w = (per_sample_mean(log_w, mask, sample_index) * n[sample_index]).masked_fill(
                ~mask, 0.0
            )  # [T], the sample's sum
        elif c.level == "geometric":
            log_w = per_sample_mean(log_w, mask, sample_index).masked_fill(~mask, 0.0)  # [T]
        raw = torch.exp(log_w.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # [T]
        zero = torch.zeros_like(mask)
        truncated, outside = zero, zero
        if c.mode == "off":
            weight = torch.ones_like(raw)  # [T]
        elif c.mode == "truncate":
            truncated = (raw > c.cap) & mask if c.cap is not None else zero
            weight = raw.clamp(max=c.cap) if c.cap is not None else raw  # [T]
        else:
            outside = (raw > c.cap if c.cap is not None else zero) | (
                raw < c.floor if c.floor is not None else zero
            )
            outside = outside & mask
            weight = raw.masked_fill(outside, 0.0)  # [T]
        negative = zero
        if c.negative_threshold is not None:
            gap = (behaviour - current).masked_fill(~mask, 0.0)  # [T]
            drift = per_sample_mean(gap, mask, sample_index)  # [T]
            negative = (adv < 0) & (drift > c.negative_threshold) & mask  # [T]
            weight = weight.masked_fill(negative, 0.0)
        weight = weight.masked_fill(~mask, 0.0).detach()
        sums = {
            "is_weight_sum": weight.sum(),
            "is_weight_max": raw.masked_fill(~mask, 0.0).max(),  # before the cap or mask
            "is_truncated_sum": truncated.sum(),
            "is_masked_sum": outside.sum(),
            "negative_masked_sum": negative.sum(),
        }
        return weight, sums
