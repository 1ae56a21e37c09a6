"""Parameters the model holds under other names than its checkpoint files.

transformers 5 keeps some families' weights in another layout than their files, and
converts them as it loads: a mixture-of-experts layer holds its experts fused
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) where the files
hold one tensor per expert (`mlp.experts.3.gate_proj.weight`). The conversions are the
family's own (`transformers.conversion_mapping`). This module applies them both ways: the
trainer's load builds a parameter from the stored tensors (`converted_sources`), and the
push sends it in the files' layout (`file_layout`), the one vLLM's loaders read."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor, nn


@dataclass
class Converted:
    """One parameter built from stored tensors: `sources` maps each of the converter's
    source patterns to its stored names, in expert order."""

    converter: Any  # transformers.core_model_loading.WeightConverter
    sources: dict[str, list[str]]

    def load(self, files: dict[str, Path]) -> Tensor:
        """The whole parameter, built from the stored tensors."""
        from safetensors import safe_open

        inputs: dict[str, Any] = {}
        for pattern, names in self.sources.items():
            tensors = []
            for name in names:
                with safe_open(str(files[name]), framework="pt") as f:
                    tensors.append(f.get_tensor(name))
            inputs[pattern] = tensors
        c = self.converter
        for op in c.operations:
            inputs = op.convert(inputs, c.source_patterns, c.target_patterns)
        (tensor,) = inputs.values()
        return tensor


def _converters(model: nn.Module) -> list[Any]:
    cached = getattr(model, "_async_grpo_converters", None)
    if cached is None:
        from transformers.conversion_mapping import get_model_conversion_mapping

        cached = [c for c in get_model_conversion_mapping(model) if hasattr(c, "operations")]
        model._async_grpo_converters = cached
    return cached


def converted_sources(model: nn.Module, name: str, stored: Any) -> Converted | None:
    """How parameter `name` of `model` is built from the `stored` tensor names, or None
    where no conversion of the family makes it."""
    for converter in _converters(model):
        for target in converter.target_patterns:
            if not name.endswith(target):
                continue
            prefix = name[: -len(target)]
            sources = {}
            for pattern in converter.source_patterns:
                rx = re.compile(re.escape(prefix + pattern).replace(r"\*", r"(\d+)") + "$")
                found = sorted((int(m.group(1)), k) for k in stored if (m := rx.match(k)))
                sources[pattern] = [k for _, k in found]
            if all(sources.values()):
                return Converted(converter, sources)
    return None


def file_layout(model: nn.Module, name: str, tensor: Tensor) -> dict[str, Tensor] | None:
    """Parameter `name` (`tensor`, the whole of it; a meta tensor gives the shapes) as the
    tensors of the files' layout, by name; None where the parameter is stored as it is."""
    converters = _converters(model)
    if not any(name.endswith(t) for c in converters for t in c.target_patterns):
        return None
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, {name: tensor})
