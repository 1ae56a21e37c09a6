"""Dense SDPA: the mask is materialised as [T, T] (what runs on CPU)."""

from __future__ import annotations

from typing import Any

from async_grpo.core.attention.base import AttentionBackend, layer_windows, one_or_per_layer
from async_grpo.core.packing import (
    PackedBatch,
    additive_mask,
    block_causal_mask,
    shared_prefix_mask,
)


class DenseAttention(AttentionBackend):
    """transformers' SDPA. Unshared rows pass no mask: transformers builds the block-diagonal
    causal mask from the restarting `position_ids` (only with `use_cache=False`, which
    `packed_forward`/`packed_hidden` always pass). Shared-prompt rows get the boolean
    `shared_prefix_mask`, one per sliding window the model's layers use. A family that
    soft-caps its attention logits (Gemma-2) runs transformers' eager attention, which
    applies the cap (SDPA cannot), with the same masks made additive. Cost and memory grow
    with the square of the row length."""

    name = "sdpa"
    hf_implementation = "sdpa"

    def __init__(self, explicit_mask: bool = False) -> None:
        self.explicit_mask = explicit_mask  # build the block mask even for unshared rows

    def implementation(self, config: Any) -> str:
        return "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"

    def mask(self, batch: PackedBatch, dtype: Any, config: Any = None) -> Any:
        if batch.needs_explicit_mask:
            windows = layer_windows(config)
            masks = {k: shared_prefix_mask(batch, w) for k, w in windows.items()}  # bool
            if getattr(config, "_attn_implementation", "sdpa") == "eager":
                masks = {k: additive_mask(m, dtype) for k, m in masks.items()}
            return one_or_per_layer(masks)  # [1, 1, T, T] each
        if self.explicit_mask:
            return block_causal_mask(batch.seq_lens, dtype).to(batch.input_ids.device)
        return None
