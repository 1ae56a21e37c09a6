"""Dense SDPA: the mask is materialised as [T, T] (what runs on CPU)."""

from __future__ import annotations

from typing import Any

from async_grpo.core.attention.base import AttentionBackend
from async_grpo.core.packing import PackedBatch, block_causal_mask, shared_prefix_mask


class DenseAttention(AttentionBackend):
    """transformers' SDPA. Unshared rows pass no mask: transformers builds the block-diagonal
    causal mask from the restarting `position_ids` (only with `use_cache=False`, which
    `packed_forward`/`packed_hidden` always pass). Shared-prompt rows get the boolean
    `shared_prefix_mask`. Cost and memory grow with the square of the row length."""

    name = "sdpa"
    hf_implementation = "sdpa"

    def __init__(self, explicit_mask: bool = False) -> None:
        self.explicit_mask = explicit_mask  # build the block mask even for unshared rows

    def mask(self, batch: PackedBatch, dtype: Any) -> Any:
        if batch.needs_explicit_mask:
            return shared_prefix_mask(batch)  # [1, 1, T, T] bool
        if self.explicit_mask:
            return block_causal_mask(batch.seq_lens, dtype).to(batch.input_ids.device)
        return None
