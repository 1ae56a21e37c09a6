"""Several optimizer updates per generated batch (`trainer.mini_batches`, `trainer.epochs`).

The batcher sends a step's trained groups in parts (whole groups in slot order, each part
in rounds of its own, `Minibatch.part`); the trainer has kept every round with the
proximal log-probs of the policy before the first update (`Trainer._accumulate`). Here
each part is run forward and backward and updated in turn, `epochs` times
(docs/loss.md, "Several updates per batch").
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from async_grpo.batcher.types import EndOfBatch
from async_grpo.core.loss import summarize_metrics


def several_updates(tr: Any, acc: dict[str, Any], eob: EndOfBatch) -> tuple[float, float]:
    """Several optimizer updates on the batch: `trainer.epochs` passes over its parts
    (`trainer.mini_batches`, whole groups each, as the batcher sent them), each part
    normalised by its own global count plus its share of the skipped samples. The
    ratio is against the policy before the first update (`old_logprobs`, taken as the
    rounds came). Fills `acc["sums"]` over every update and the per-update figures;
    returns the mean grad norm and the last lr."""
    t = tr.cfg.trainer
    defer = t.defer_grad_sync and tr.world > 1
    parts: dict[int, list[Any]] = defaultdict(list)
    for part, batch in acc.pop("kept"):
        parts[part].append(batch)
    index = 0 if tr.loss_fn.aggregation_name == "token_mean" else 1
    counted = [c[index] for c in eob.part_counts]
    skipped = eob.skipped_tokens if index == 0 else eob.skipped_samples
    norms, lr, clip, losses = [], 0.0, [], []
    for _ in range(t.epochs):
        for part in sorted(parts):
            sums: dict[str, float] = defaultdict(float)
            for k, batch in enumerate(parts[part]):
                if defer:  # reduce in the part's last backward, as every rank does
                    tr.policy.set_requires_gradient_sync(k == len(parts[part]) - 1)
                tr.forward_backward(batch, sums)
            own = counted[part]
            if not own:  # no loss token in this part: nothing to update
                tr.opt.zero_grad(set_to_none=True)
                continue
            denom = own + skipped * own / max(sum(counted), 1)
            norm, lr = tr.optimize(denom)
            norms.append(norm)
            for key, v in sums.items():
                if key.endswith("_max"):
                    acc["sums"][key] = max(acc["sums"].get(key, float("-inf")), v)
                else:
                    acc["sums"][key] += v
            reduced = reduced_counts(sums, tr.world)
            losses.append(reduced.pop("loss_total") / denom)
            summary = summarize_metrics(reduced)
            clip.append(summary.get("clip_low_frac", 0.0) + summary.get("clip_high_frac", 0.0))
    acc["update_figures"] = {
        "updates": float(len(norms)),
        "loss": sum(losses) / len(losses) if losses else 0.0,
        "clip_fraction/first_update": clip[0] if clip else 0.0,
        "clip_fraction/last_update": clip[-1] if clip else 0.0,
    }
    return (sum(norms) / len(norms) if norms else 0.0), lr


def reduced_counts(sums: dict[str, float], world: int) -> dict[str, float]:
    """One update's loss, token and clip counts summed over the ranks."""
    keys = ["loss_total", "tokens", "clip_low_sum", "clip_high_sum"]
    flat = torch.tensor([sums.get(k, 0.0) for k in keys], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(flat)
    return dict(zip(keys, flat.tolist(), strict=True))
