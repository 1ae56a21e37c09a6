"""Choosing a transport per worker, and opening a worker's end from its init info."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from async_grpo.transports.base import Receiver

TRANSPORTS = ("auto", "broadcast", "shm", "cuda_ipc")


@dataclass(frozen=True)
class Place:
    """Where a process computes: its Ray node and its device ("cpu" or a GPU's uuid).
    A worker that cannot share memory with the trainer (`broadcast_only`) says so."""

    node_id: str
    device: str
    broadcast_only: bool = False


def choose_transport(forced: str, trainer: Place, worker: Place) -> tuple[str, str]:
    """(transport, why) for one worker. `forced` is the config's choice; a forced
    same-node transport the placement cannot use is an error naming both places."""
    if forced not in TRANSPORTS:
        raise ValueError(f"weight transport must be one of {TRANSPORTS}, got {forced!r}")
    same_node = trainer.node_id == worker.node_id and not worker.broadcast_only
    shm_ok = same_node and trainer.device == worker.device == "cpu"
    ipc_ok = same_node and trainer.device == worker.device != "cpu"
    if forced == "shm" and not shm_ok:
        raise ValueError(
            "weight transport 'shm' needs the worker on the trainer's node, both on CPU;"
            f" trainer {trainer}, worker {worker}"
        )
    if forced == "cuda_ipc" and not ipc_ok:
        raise ValueError(
            f"weight transport 'cuda_ipc' needs the worker on the trainer's GPU;"
            f" trainer {trainer}, worker {worker}"
        )
    if forced == "broadcast":
        return "broadcast", "forced by trainer.weight_transport"
    if worker.broadcast_only:
        return "broadcast", "asked for by the worker (generation.weight_transport)"
    if shm_ok:
        return "shm", "same node, CPU"
    if ipc_ok:
        return "cuda_ipc", "same GPU"
    return "broadcast", "same node, another device" if same_node else "another node"


class PlainSlots:
    """Two slots in ordinary memory: what a push needs when every worker is remote."""

    kind = "plain"

    def __init__(self, slot_bytes: int, device: str = "cpu") -> None:
        self.slot_bytes = slot_bytes
        self.flat = torch.empty(2 * slot_bytes, dtype=torch.uint8, device=device)

    def slot(self, i: int) -> torch.Tensor:
        return self.flat[i * self.slot_bytes : (i + 1) * self.slot_bytes]  # [slot_bytes]

    def close(self) -> None:
        self.flat = None


def make_slots(kinds: set[str], slot_bytes: int, device: str):  # noqa: ANN201 - one of three
    """The trainer's slots: GPU memory on CUDA (IPC and NCCL both read it), a /dev/shm
    file where a CPU worker shares the node, plain memory otherwise."""
    if device == "cuda":
        from async_grpo.transports.cuda_ipc import CudaSlots

        return CudaSlots(slot_bytes)
    if "shm" in kinds:
        from async_grpo.transports.shm import SharedSlots

        return SharedSlots(slot_bytes)
    return PlainSlots(slot_bytes)


def open_receiver(info: dict) -> Receiver:
    """A worker's end of the transport described by `info` (the trainer's init info;
    for a broadcast, `rank` is this process's rank in the group)."""
    kind = info["kind"]
    if kind == "broadcast":
        from async_grpo.transports.broadcast import BroadcastReceiver

        return BroadcastReceiver(
            info["host"],
            info["port"],
            info["rank"],
            info["world_size"],
            info["backend"],
            info["timeout_s"],
            info["slot_bytes"],
        )
    if kind == "shm":
        from async_grpo.transports.shm import ShmReceiver

        return ShmReceiver(info["path"], info["slot_bytes"])
    if kind == "cuda_ipc":
        from async_grpo.transports.cuda_ipc import IpcReceiver

        return IpcReceiver(info["handle"], info["slot_bytes"])
    raise ValueError(f"unknown weight transport {kind!r} in init info")
