"""DAPO's soft overlong penalty (Yu et al. 2025): a completion of L tokens, with the limit
L_max = generation.max_new_tokens and a ramp of `buffer` tokens before it, gets

    0                                          L <= L_max - buffer
    -penalty * (L - (L_max - buffer)) / buffer  L_max - buffer < L <= L_max

added to its reward, as the component `overlong`. With penalty 1 this is TRL's
`get_soft_overlong_punishment` and verl's `overlong_buffer` with `penalty_factor` 1. It is
applied where token counts are known (the batcher, single-turn groups), not in a reward
function, so a held-out evaluation scores answers without it.
"""

from __future__ import annotations

from async_grpo.config import OverlongConfig


def overlong_penalty(length: int, max_tokens: int, cfg: OverlongConfig) -> float:
    """The penalty (<= 0) of a completion of `length` tokens under the limit `max_tokens`."""
    if not cfg.buffer:
        return 0.0
    over = length - (max_tokens - cfg.buffer)
    return -cfg.penalty * min(max(over, 0), cfg.buffer) / cfg.buffer
