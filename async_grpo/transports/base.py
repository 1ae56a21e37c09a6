"""What every transport shares: tensor metadata, chunk planning, the receiver interface.

A push moves the model as a sequence of chunks. A chunk holds whole layers (every tensor
whose name has the same outermost index, e.g. `model.layers.3.`), so when a worker has
loaded a chunk, vLLM has processed every layer in it and keeps no reference to the
chunk's memory; the slot can then be reused. Both sides derive the chunks from the same
`metas` list, so only names, shapes and slot numbers cross Ray.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

CHUNK_BYTES = 32 << 20  # a chunk grows by whole layers up to this size
ALIGN = 64  # every tensor starts on a 64-byte boundary inside a chunk


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "bfloat16"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * getattr(torch, self.dtype).itemsize


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layer_key(name: str) -> str:
    """The part of a name up to its first all-digit segment (`model.layers.3`), or ""
    for un-indexed names (embeddings, final norm, head): tensors with one key load together."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def plan_chunks(metas: list[TensorMeta], limit: int = CHUNK_BYTES) -> list[list[int]]:
    """Consecutive runs of whole layers (indices into `metas`), each at most `limit` bytes
    unless one layer alone is larger. Un-indexed tensors form one group per run between
    layers (embeddings before, norm and head after)."""
    groups: list[list[int]] = []
    last = None
    for i, m in enumerate(metas):
        key = layer_key(m.name)
        if not groups or key != last:
            groups.append([])
            last = key
        groups[-1].append(i)
    chunks: list[list[int]] = []
    size = 0
    for g in groups:
        g_bytes = sum(_aligned(metas[i].nbytes) for i in g)
        if chunks and size + g_bytes <= limit:
            chunks[-1].extend(g)
            size += g_bytes
        else:
            chunks.append(list(g))
            size = g_bytes
    return chunks


def chunk_bytes(metas: list[TensorMeta], chunk: list[int]) -> int:
    return sum(_aligned(metas[i].nbytes) for i in chunk)


def slot_bytes(metas: list[TensorMeta], chunks: list[list[int]]) -> int:
    """The size a slot needs to hold any chunk of this plan."""
    return max((chunk_bytes(metas, c) for c in chunks), default=0)


def view_at(flat: torch.Tensor, offset: int, meta: TensorMeta) -> tuple[torch.Tensor, int]:
    """The tensor `meta` describes, viewed at byte `offset` of the uint8 `flat`, and the
    offset where the next tensor starts."""
    n = meta.nbytes
    view = flat[offset : offset + n].view(getattr(torch, meta.dtype)).view(meta.shape)
    return view, offset + _aligned(n)


def pack(slot: torch.Tensor, metas: list[TensorMeta], tensors: list[torch.Tensor]) -> int:
    """Copy (casting) `tensors` into the uint8 `slot`, each at its aligned offset; bytes used."""
    offset = 0
    for m, t in zip(metas, tensors, strict=True):
        dst, offset = view_at(slot, offset, m)
        dst.copy_(t.detach())
    return offset


def unpack(flat: torch.Tensor, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views of the tensors `pack` wrote into the uint8 `flat` (no copy)."""
    out, offset = [], 0
    for m in metas:
        view, offset = view_at(flat, offset, m)
        out.append((m.name, view))
    return out


class Receiver(ABC):
    """A worker's end of one transport: turns a chunk announcement into its bytes."""

    kind: str

    @abstractmethod
    def chunk(self, slot: int, nbytes: int) -> torch.Tensor:
        """The chunk's bytes (uint8 [nbytes]); valid until the sender reuses `slot`."""

    def close(self) -> None:  # noqa: B027 - most transports hold nothing to release
        """Release what `__init__` opened."""
