"""The one place a push kind is picked: by the name the trainer sends, or for a
checkpoint folder by what it holds."""

from __future__ import annotations

from async_grpo.inference.push_kinds.adapter import AdapterPush
from async_grpo.inference.push_kinds.base import PushKind
from async_grpo.inference.push_kinds.weights import WeightsPush

KINDS: dict[str, type[PushKind]] = {k.name: k for k in (WeightsPush, AdapterPush)}


def push_kind(name: str) -> PushKind:
    """The kind the trainer named (`info["payload"]`)."""
    try:
        return KINDS[name]()
    except KeyError:
        raise ValueError(f"unknown push kind {name!r}; known: {sorted(KINDS)}") from None


def kind_of_folder(folder: str) -> PushKind:
    """The kind a checkpoint folder holds: an adapter (PEFT's files) or whole weights."""
    from async_grpo.adapters import is_adapter_dir

    return AdapterPush() if is_adapter_dir(folder) else WeightsPush()
