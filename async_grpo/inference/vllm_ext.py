"""Our weight-transfer engine inside vLLM (vLLM's own weight-transfer API).

vLLM 0.32 drives weight updates through a `WeightTransferEngine` per engine worker:
`init_transfer_engine` once, then per push `start_weight_update`, one `update_weights`
per chunk and `finish_weight_update`. This module registers ours as backend
"async_grpo": it receives each chunk through the transport the trainer chose for this
worker (broadcast group, shared memory or CUDA IPC; see async_grpo.transports) and hands
the tensors to vLLM's layerwise reload, which shards, repacks (CPU) and processes each
layer as soon as its last tensor arrives; what it does with each chunk's tensors is the
push kind's (inference/push_kinds: the model's weights, or an adapter's folder). Imported in the engine's worker process through
`worker_extension_cls`, which is how the registration reaches that process.

With `generation.cpu_linear: torch` a CPU engine keeps plain linear layers (vLLM falls back
to `torch.nn.functional.linear` when oneDNN is switched off before the model loads), so
nothing is repacked and every weight stays in place: an update is then vLLM's loader
writing into those weights, without the layerwise rebuild.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from async_grpo.inference.owner import exit_with_owner
from async_grpo.inference.push_kinds import PushKind, push_kind
from async_grpo.inference.types import VLLM_LORA_OPS_ENV
from async_grpo.inference.vllm_reload import HEAD, PLAIN_LINEAR, has_head, reloads_in_place
from async_grpo.transports.base import TensorMeta, unpack
from async_grpo.transports.select import open_receiver

BACKEND = "async_grpo"


@dataclass
class TransportInit(WeightTransferInitInfo):
    """The trainer's init info for one worker: the transport and how to reach it."""

    info: dict[str, Any]


@dataclass
class ChunkAnnouncement(WeightTransferUpdateInfo):
    """One chunk: which tensors, in which slot, how many bytes."""

    metas: list[tuple[str, list[int], str]]
    slot: int
    nbytes: int


class AsyncGrpoTransferEngine(WeightTransferEngine[TransportInit, ChunkAnnouncement]):
    init_info_cls = TransportInit
    update_info_cls = ChunkAnnouncement
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        exit_with_owner()  # this process holds the transport: it must not outlive its actor
        self.receiver: Any = None
        self._in_place = False  # this update writes into the weights where they are
        self.kind: PushKind = push_kind("weights")  # what the chunks hold (trainer's payload)
        self.adapter_config: dict[str, Any] = {}
        self.adapter_target = ""  # the folder the adapter of the update under way goes to
        self._adapter: dict[str, torch.Tensor] = {}

    def init_transfer_engine(self, init_info: TransportInit) -> None:
        self.shutdown()
        info = dict(init_info.info)
        if info["kind"] == "broadcast":  # every tensor-parallel shard is its own rank
            info["rank"] = info["rank_offset"] + int(self.parallel_config.rank)
        self.kind = push_kind(info.get("payload", "weights"))
        self.adapter_config = info.get("adapter_config") or {}
        self.receiver = open_receiver(info)

    def start_weight_update(self) -> None:
        self.kind.start(self)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.current_accelerator() is not None:  # none on CPU
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: ChunkAnnouncement) -> None:
        if self.receiver is None:
            raise RuntimeError("weight chunk received before init_weight_transfer_engine")
        flat = self.receiver.chunk(update_info.slot, update_info.nbytes)
        metas = [TensorMeta(n, tuple(s), d) for n, s, d in update_info.metas]
        self.kind.receive(self, unpack(flat, metas), flat)

    def finish_weight_update(self) -> None:
        self.kind.finish(self)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


def register() -> None:
    """Make backend "async_grpo" known to vLLM in this process (idempotent); with
    `generation.cpu_linear: torch`, keep oneDNN from repacking the linear layers; on CPU,
    LoRA's matmuls one per adapter (cpu_lora.py)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, AsyncGrpoTransferEngine)
    if torch.accelerator.current_accelerator() is None and not os.environ.get(VLLM_LORA_OPS_ENV):
        from async_grpo.inference import cpu_lora

        cpu_lora.install()
    if PLAIN_LINEAR:
        import vllm._custom_ops as ops

        ops._supports_onednn = False  # read when each linear layer is set up


class WeightSyncExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): importing this module is what
    registers the engine in the worker process; `self` is vLLM's worker at run time."""

    def async_grpo_reload_kind(self) -> str:
        """How this engine takes an update: "in_place" (plain weights written where they
        are) or "layerwise" (vLLM rebuilds, loads and processes each layer)."""
        return "in_place" if reloads_in_place(self.model_runner.get_model()) else "layerwise"

    def async_grpo_adapter_target(self, folder: str) -> None:
        """Where the adapter of the next update is written (a pushed version's folder)."""
        self.weight_transfer_engine.adapter_target = folder

    def async_grpo_load_dir(self, hf_dir: str) -> int:
        """Reload every tensor of a Hugging Face folder in place; returns tensors loaded.

        A tied LM head is saved only as the embedding; on CPU vLLM keeps a repacked copy of
        the head that only `lm_head.weight` itself refreshes, so it is added here."""
        import json
        from pathlib import Path

        from safetensors.torch import load_file

        folder = Path(hf_dir)
        pairs: dict[str, torch.Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            pairs |= load_file(str(f))
        config = json.loads((folder / "config.json").read_text())
        embed = "model.embed_tokens.weight"
        model = self.model_runner.get_model()
        tied = config.get("tie_word_embeddings")
        if tied and HEAD not in pairs and embed in pairs and has_head(model):
            pairs[HEAD] = pairs[embed]
        self.reload_weights(weights_iterator=iter(pairs.items()))
        return len(pairs)


register()
