"""The interface every attention backend implements for packed rows."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from async_grpo.core.packing import PackedBatch


class AttentionBackend(ABC):
    """How a packed row's samples are kept apart inside the model's attention.

    `hf_implementation` is the `attn_implementation` the model must be loaded with;
    `prepare` may pad the row (the loss then sees the padded batch: pad positions carry no
    loss token); `mask` is what goes to the model as `attention_mask` (None: the model
    derives isolation from the restarting `position_ids`)."""

    name: str
    hf_implementation: str
    supports_backward_on_cpu: bool = True

    def prepare(self, batch: PackedBatch) -> PackedBatch:
        return batch

    @abstractmethod
    def mask(self, batch: PackedBatch, dtype: Any) -> Any:
        """The `attention_mask` for `batch` (a model in `dtype`), or None."""

    def stats(self) -> dict[str, float]:
        """Per-run counters for the metrics (e.g. how many row shapes were compiled)."""
        return {}
