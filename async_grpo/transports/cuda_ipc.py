"""CUDA IPC transport (same GPU): two slots in the trainer's GPU memory.

NCCL refuses two ranks on one GPU, so a worker sharing the trainer's GPU cannot join the
broadcast group. Instead the trainer allocates the slots once and hands the worker a
CUDA IPC handle; the worker opens the same memory and reads each chunk in place.
"""

from __future__ import annotations

import pickle

import torch

from async_grpo.transports.base import Receiver


class CudaSlots:
    """The trainer's end: two slots of `slot_bytes` on its current GPU."""

    kind = "cuda_ipc"

    def __init__(self, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.flat = torch.empty(2 * slot_bytes, dtype=torch.uint8, device="cuda")

    def slot(self, i: int) -> torch.Tensor:
        return self.flat[i * self.slot_bytes : (i + 1) * self.slot_bytes]  # [slot_bytes]

    def worker_info(self) -> dict:
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(self.flat)
        # trainer-made bytes on our own control plane: the worker unpickles a handle tuple
        return {"handle": pickle.dumps(args), "slot_bytes": self.slot_bytes}

    def close(self) -> None:
        self.flat = None


class IpcReceiver(Receiver):
    """The worker's end: the trainer's slots opened once on this process's GPU."""

    kind = "cuda_ipc"

    def __init__(self, handle: bytes, slot_bytes: int, device_index: int | None = None) -> None:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = list(pickle.loads(handle))
        # the 7th field is the device index in the sender's numbering; use ours
        args[6] = torch.cuda.current_device() if device_index is None else device_index
        self.slot_bytes = slot_bytes
        self.flat = rebuild_cuda_tensor(*args)

    def chunk(self, slot: int, nbytes: int) -> torch.Tensor:
        # the trainer synchronised its copy into the slot before announcing the chunk
        start = slot * self.slot_bytes
        return self.flat[start : start + nbytes]  # [nbytes]

    def close(self) -> None:
        self.flat = None
