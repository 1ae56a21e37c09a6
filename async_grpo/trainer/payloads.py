"""What a weight push sends: the full weights, the adapters alone, or the adapters merged.

A payload names the parameters every trainer rank gathers, in one order (`params`; a
gather is a collective), and what goes on the wire: tensors by the names the workers load
them under (`wire`). A wire tensor is built from a run of consecutive gathered parameters
(`sources`): one parameter for the full weights and the adapters, a base weight and its
two factors for a merged push. Each names the push kind the workers receive it as
(`kind`, inference/push_kinds: the same class on both sides). `select_payload` picks one
from the policy and `trainer.lora.push`.

- `FullWeights`: every parameter, by the model files' names and layout (fused experts go
  as the files' per-expert tensors).
- `AdapterOnly` (`lora.push: adapter`): the factors alone, by PEFT's saved names; each
  worker serves them as a LoRA adapter of its own version (`kind` "adapter").
- `MergedAdapter` (`lora.push: merged`): full weights, each adapted one as
  `W + (alpha / r) * B @ A` (computed in fp32), for engines without LoRA.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from async_grpo import adapters
from async_grpo.adapters import ADAPTER_NAME, adapter_file_name, merged
from async_grpo.inference.push_kinds.adapter import AdapterPush
from async_grpo.inference.push_kinds.base import PushKind
from async_grpo.inference.push_kinds.weights import WeightsPush
from async_grpo.trainer import lora as lora_module
from async_grpo.trainer.weight_names import file_layout

# (wire name, whole shape, index of its first source parameter, part of its layout)
Wire = tuple[str, tuple[int, ...], int, str | None]


class Payload:
    """`params`: (name, parameter) in gather order; `sources[i]`: how many parameters from
    index i build wire tensors together (0 inside a run); `wire`: what is sent."""

    kind: type[PushKind] = WeightsPush  # what the workers do with it (inference/push_kinds)

    def __init__(self, hf: nn.Module) -> None:
        self.hf = hf
        self.params: list[tuple[str, Tensor]] = []
        self.sources: list[int] = []
        self.wire: list[Wire] = []

    def _add(
        self, named: list[tuple[str, Tensor]], wire: list[tuple[str, tuple[int, ...], str | None]]
    ) -> None:
        start = len(self.params)
        self.params += named
        self.sources += [len(named)] + [0] * (len(named) - 1)
        self.wire += [(n, shape, start, part) for n, shape, part in wire]

    def _add_stored(self, name: str, p: Tensor) -> None:
        """One parameter by its files' name, whole or in the files' layout."""
        shape = tuple(p.shape)  # global: a DTensor reports the whole parameter's
        parts = file_layout(self.hf, name, torch.empty(shape, device="meta"))
        if parts is None:
            self._add([(name, p)], [(name, shape, None)])
        else:
            self._add([(name, p)], [(k, tuple(t.shape), k) for k, t in parts.items()])

    def build(self, index: int, fulls: list[Tensor]) -> dict[str | None, Tensor]:
        """The wire tensors (by part) of the run of parameters starting at `index`, from
        those parameters gathered whole (`fulls`)."""
        name = self.params[index][0]
        parts = file_layout(self.hf, name, fulls[0])
        return {None: fulls[0]} if parts is None else parts


def _named(policy: nn.Module) -> list[tuple[str, Tensor]]:
    """Every parameter by its name in the HF model; tied weights under both names (on CPU
    vLLM keeps a repacked copy of the LM head, refreshed only when `lm_head.weight` itself
    arrives)."""
    from async_grpo.trainer.model import PREFIX

    named = policy.named_parameters(remove_duplicate=False)
    return [(n.removeprefix(PREFIX), p) for n, p in named]


class FullWeights(Payload):
    def __init__(self, policy: nn.Module) -> None:
        super().__init__(getattr(policy, "hf", policy))
        for name, p in _named(policy):
            self._add_stored(name, p)


class AdapterOnly(Payload):
    kind = AdapterPush

    def __init__(self, policy: nn.Module) -> None:
        super().__init__(policy.hf)
        for name, p in _named(policy):
            if adapters.is_adapter(name):
                wire = adapter_file_name(name)
                self._add([(name, p)], [(wire, tuple(p.shape), None)])

    def build(self, index: int, fulls: list[Tensor]) -> dict[str | None, Tensor]:
        return {None: fulls[0]}


class MergedAdapter(Payload):
    def __init__(self, policy: nn.Module) -> None:
        super().__init__(policy.hf)
        self.factor = lora_module.scale(policy.lora)
        named = dict(_named(policy))
        for name, p in _named(policy):
            if adapters.is_adapter(name):
                continue
            if ".base_layer." not in name:
                self._add_stored(lora_module.stored_name(name), p)
                continue
            module = name.rpartition(".base_layer.")[0]
            a = named[f"{module}.lora_A.{ADAPTER_NAME}.weight"]
            b = named[f"{module}.lora_B.{ADAPTER_NAME}.weight"]
            stored = lora_module.stored_name(name)
            self._add([(name, p), ("A", a), ("B", b)], [(stored, tuple(p.shape), None)])

    def build(self, index: int, fulls: list[Tensor]) -> dict[str | None, Tensor]:
        if self.sources[index] == 3:
            weight, a, b = fulls
            return {None: merged(weight, a, b, self.factor)}
        return super().build(index, fulls)


def select_payload(policy: nn.Module) -> Payload:
    """The payload of this policy: full weights, or under LoRA what `lora.push` asks for."""
    lora: Any = getattr(policy, "lora", None)
    if lora is None:
        return FullWeights(policy)
    return AdapterOnly(policy) if lora.push == "adapter" else MergedAdapter(policy)
