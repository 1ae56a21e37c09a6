"""Dense SDPA: the mask is materialised as [T, T] (what runs on CPU)."""

from __future__ import annotations

from typing import Any

from async_grpo.core.attention.base import (
    AttentionBackend,
    layer_windows,
    one_or_per_layer,
    supports,
)
from async_grpo.core.packing import PackedBatch, additive_mask, shared_prefix_mask


class DenseAttention(AttentionBackend):
    """transformers' SDPA with the row's mask built here: `shared_prefix_mask` (each sample
    sees its own tokens and its group's shared prompt), one per sliding window the model's
    layers use. Not every family derives packed samples' isolation from restarting
    `position_ids` (Falcon, GPT-OSS: 0.1-0.9 nats off without a mask), so the mask is always
    explicit. A family that soft-caps its attention logits (Gemma-2) runs transformers'
    eager attention, which applies the cap (SDPA cannot), with the same masks made additive;
    so does a family whose transformers model has no SDPA path (GPT-J, Bloom, GPT-OSS).
    Cost and memory grow with the square of the row length."""

    name = "sdpa"
    hf_implementation = "sdpa"

    def implementation(self, config: Any) -> str:
        if getattr(config, "attn_logit_softcapping", None) or not supports(config, "sdpa"):
            return "eager"
        return "sdpa"

    def mask(self, batch: PackedBatch, dtype: Any, config: Any = None) -> Any:
        windows = layer_windows(config)
        masks = {k: shared_prefix_mask(batch, w) for k, w in windows.items()}  # bool
        if getattr(config, "_attn_implementation", "sdpa") == "eager":
            masks = {k: additive_mask(m, dtype) for k, m in masks.items()}
        return one_or_per_layer(masks)  # [1, 1, T, T] each
