"""A trainer step's books: what every rank ran, summed over the ranks and checked against
what the batcher says it sent, and the step's metrics row.

The batcher's EndOfBatch carries the step's global counts (loss tokens and samples, the
skipped ones included) and how many samples it sent; the ranks' sums must equal them, or
the step stops with both figures rather than dividing the gradient by a wrong count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from async_grpo.batcher.types import EndOfBatch


@dataclass
class StepBooks:
    """The step over all ranks: loss tokens and samples (skipped ones included), tokens
    run, the loss terms' sums, and the gradient's divisor (`denom`, per the aggregation)."""

    tokens: int
    samples: int
    all_tokens: float
    sums: dict[str, float]
    denom: int


def reduce_books(
    acc: dict[str, Any], eob: EndOfBatch, step: int, rank: int, aggregation: str
) -> StepBooks:
    """Sum this rank's `acc` over the ranks (one all-reduce) and check it against `eob`."""
    if eob.step != step or acc["passes"] != eob.num_minibatches:
        raise RuntimeError(
            f"rank {rank}: step {step} ran {acc['passes']} minibatches, the batcher"
            f" closed step {eob.step} after {eob.num_minibatches}"
        )
    keys = sorted(k for k in acc["sums"] if not k.endswith("_max"))
    flat = torch.tensor(
        [*acc["counts"], acc["tokens"], acc["received"], *(acc["sums"][k] for k in keys)],
        dtype=torch.float64,
    )  # host tensor: the default group carries cpu tensors over gloo on every device
    dist.all_reduce(flat)
    tokens, samples, all_tokens = int(flat[0]), int(flat[1]), float(flat[2])
    received = int(flat[3])
    sums = dict(zip(keys, flat[4:].tolist(), strict=True))
    sums |= _maxima(acc["sums"])
    sent = eob.stats.get("samples/trained", received)
    if received != sent:  # the books say each sample is trained once: check it
        raise RuntimeError(
            f"step {step}: the ranks received {received} samples, the batcher sent {sent:.0f}"
        )
    tokens, samples = tokens + eob.skipped_tokens, samples + eob.skipped_samples
    if (tokens, samples) != (eob.global_tokens, eob.global_samples):
        raise RuntimeError(
            f"step {step}: trainer counted {tokens} tokens / {samples} samples"
            f" (skipped ones included), batcher {eob.global_tokens} / {eob.global_samples}"
        )
    denom = tokens if aggregation == "token_mean" else samples
    return StepBooks(tokens, samples, all_tokens, sums, denom)


def _maxima(sums: dict[str, float]) -> dict[str, float]:
    """The `*_max` metrics over the ranks (every rank has the same keys: the loss returns
    them for every minibatch, the placeholder's included)."""
    keys = sorted(k for k in sums if k.endswith("_max"))
    if not keys:
        return {}
    flat = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    return dict(zip(keys, flat.tolist(), strict=True))
