"""flash-attn varlen: transformers' `flash_attention_2` on packed `position_ids` (CUDA only)."""

from __future__ import annotations

import importlib.util
from typing import Any

from async_grpo.core.attention.base import AttentionBackend
from async_grpo.core.packing import PackedBatch


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


class FlashVarlenAttention(AttentionBackend):
    """transformers turns restarting `position_ids` into `cu_seqlens` and calls flash-attn's
    varlen kernel: no mask, work linear in the samples' own lengths. It cannot express a
    shared prompt (a segment seeing another segment's prefix): such rows are refused."""

    name = "flash"
    hf_implementation = "flash_attention_2"
    supports_backward_on_cpu = False

    def mask(self, batch: PackedBatch, dtype: Any, config: Any = None) -> Any:
        if batch.needs_explicit_mask:
            raise ValueError(
                "flash attention cannot express shared-prompt rows; use attention 'flex'"
                " or batcher.share_prompts=false"
            )
        return None
