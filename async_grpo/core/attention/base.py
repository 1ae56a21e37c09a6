"""The interface every attention backend implements for packed rows."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from async_grpo.core.packing import PackedBatch


class AttentionBackend(ABC):
    """How a packed row's samples are kept apart inside the model's attention.

    `hf_implementation` is the `attn_implementation` the model must be loaded with
    (`implementation(config)` may pick another for a family's needs); `prepare` may pad
    the row (the loss then sees the padded batch: pad positions carry no loss token);
    `mask` is what goes to the model as `attention_mask` (None: the model derives
    isolation from the restarting `position_ids`; a dict: one mask per layer type, for
    families whose layers differ in their sliding window, see `layer_windows`)."""

    name: str
    hf_implementation: str
    supports_backward_on_cpu: bool = True

    def implementation(self, config: Any) -> str:
        """The `attn_implementation` for a model of this Hugging Face `config`."""
        return self.hf_implementation

    def prepare(self, batch: PackedBatch) -> PackedBatch:
        return batch

    @abstractmethod
    def mask(self, batch: PackedBatch, dtype: Any, config: Any = None) -> Any:
        """The `attention_mask` for `batch` (a model in `dtype` with `config`), or None."""

    def stats(self) -> dict[str, float]:
        """Per-run counters for the metrics (e.g. how many row shapes were compiled)."""
        return {}


def layer_windows(config: Any) -> dict[str, int | None]:
    """Layer type -> the sliding window of its attention (None: full), as `config` declares
    them: `layer_types` where the family has them (Gemma-2/3, Qwen2/3, Cohere-2), else one
    kind of layer, windowed by `sliding_window` if set (Mistral, Phi-3). A query at
    position p sees keys at positions p - window + 1 .. p, as transformers and vLLM do."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if not kinds:
        return {"full_attention": window}
    unknown = set(kinds) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(
            f"model type {getattr(config, 'model_type', '?')!r}: layer types {sorted(unknown)}"
            " are not supported (full and sliding-window attention are)"
        )
    return {k: (window if k == "sliding_attention" else None) for k in sorted(set(kinds))}


def one_or_per_layer(masks: dict[str, Any]) -> Any:
    """A single mask where every layer takes the same one, else the dict per layer type."""
    values = list(masks.values())
    return values[0] if len(values) == 1 else masks


def supports(config: Any, implementation: str) -> bool:
    """Whether transformers' causal LM for `config` has the `implementation` attention path
    ("sdpa", "flex_attention", "flash_attention_2"); true where the class is not known."""
    from transformers import AutoModelForCausalLM

    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return True
    flag = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}.get(
        implementation, "_supports_flash_attn"
    )
    return bool(getattr(cls, flag, True))
