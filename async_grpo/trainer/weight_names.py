"""Parameters the model holds under other names or layouts than its checkpoint files.

transformers 5 keeps some families' weights otherwise than their files hold them, and
converts them as it loads: renamed blocks (Mixtral's files say `block_sparse_moe` where
the model says `mlp`), a prefix the files lack or add, and fused experts
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) where the files
hold one tensor per expert (`mlp.experts.3.gate_proj.weight`). The conversions are the
family's own (`transformers.conversion_mapping`), applied by transformers' own key
renaming (`core_model_loading.rename_source_key`) and its reversal. This module applies
them both ways: the trainer's load maps every stored tensor to the parameter it builds
(`stored_sources`), and the push sends each parameter in the files' names and layout
(`file_layout`), the ones vLLM's loaders read."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor, nn


@dataclass
class Converted:
    """One parameter built from several stored tensors: `sources` maps each of the
    converter's source patterns to its stored names, in expert order."""

    converter: Any  # transformers.core_model_loading.WeightConverter
    sources: dict[str, list[str]] = field(default_factory=dict)

    def load(self, files: dict[str, Path]) -> Tensor:
        """The whole parameter, built from the stored tensors."""
        from safetensors import safe_open

        inputs: dict[str, Any] = {}
        for pattern in self.converter.source_patterns:
            tensors = []
            for name in self.sources.get(pattern, []):
                with safe_open(str(files[name]), framework="pt") as f:
                    tensors.append(f.get_tensor(name))
            inputs[pattern] = tensors
        c = self.converter
        for op in c.operations:
            inputs = op.convert(inputs, c.source_patterns, c.target_patterns)
        (tensor,) = inputs.values()
        return tensor


def _mapping(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """The family's (renamings, converters), as transformers loads a checkpoint with them."""
    cached = getattr(model, "_async_grpo_mapping", None)
    if cached is None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        mapping = get_model_conversion_mapping(model)
        cached = (
            [m for m in mapping if isinstance(m, WeightRenaming)],
            [m for m in mapping if isinstance(m, WeightConverter)],
        )
        model._async_grpo_mapping = cached
    return cached


def stored_sources(
    model: nn.Module, names: list[str], stored: list[str]
) -> dict[str, str | Converted]:
    """For each parameter name of `model` in `names` that a `stored` tensor name makes:
    that stored name (the same tensor, maybe renamed) or how it is `Converted` from
    several. Parameters no stored tensor makes are left out."""
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    renamings, converters = _mapping(model)
    wanted = dict.fromkeys(names, True)  # rename_source_key looks names up in a dict
    prefix = getattr(model, "base_model_prefix", None)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    out: dict[str, str | Converted] = {}
    for key in sorted(stored, key=dot_natural_key):  # experts in their numeric order
        if key in wanted:
            out.setdefault(key, key)
            continue
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, wanted)
        if renamed not in wanted:
            continue
        if pattern is None:
            out.setdefault(renamed, key)
        else:
            found = out.setdefault(renamed, Converted(by_pattern[pattern]))
            if isinstance(found, Converted):
                found.sources.setdefault(pattern, []).append(key)
    return out


def file_layout(model: nn.Module, name: str, tensor: Tensor) -> dict[str, Tensor] | None:
    """Parameter `name` (`tensor`, the whole of it; a meta tensor gives the shapes) as the
    tensors of the files' names and layout, by name; None where it is stored as it is."""
    renamings, converters = _mapping(model)
    if not renamings and not converters:
        return None
    from transformers.core_model_loading import revert_weight_conversion

    parts = revert_weight_conversion(model, {name: tensor})
    return None if list(parts) == [name] else parts
