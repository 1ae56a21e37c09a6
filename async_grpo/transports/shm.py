"""Shared-memory transport (same node, CPU): two slots in a /dev/shm file.

Trainer rank 0 writes a chunk into a slot; the worker maps the same file and reads the
chunk in place, so the bytes are copied once (trainer -> slot) before vLLM loads them.
The file is created once per set of workers and reused for every push; under `async-grpo
run` it lies in the run's folder (async_grpo/shm_files.py).
"""

from __future__ import annotations

import os

import torch

from async_grpo.shm_files import SHM_DIR, new_entry
from async_grpo.transports.base import Receiver


def shm_room(directory: str = SHM_DIR) -> int:
    """Bytes free in `directory` (0 where it does not exist)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


class SharedSlots:
    """The trainer's end: two slots of `slot_bytes` in one file; removed by `close`."""

    kind = "shm"

    def __init__(self, slot_bytes: int, directory: str = SHM_DIR) -> None:
        need = 2 * slot_bytes
        room = shm_room(directory)
        if room < need:
            raise OSError(
                f"{directory} has {room / 2**20:.0f} MiB free; shared-memory weight slots need"
                f" {need / 2**20:.0f} MiB (enlarge it, e.g. docker --shm-size, or set"
                " trainer.weight_transport: broadcast)"
            )
        # in the run's folder, which the run removes however its trainer ended (a killed
        # rank cannot remove its own file); shm_files.py
        self.path = new_entry("weights", directory)
        # 0600: the weights are the run's own (the workers run as the same user)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, need)
        finally:
            os.close(fd)
        self.slot_bytes = slot_bytes
        self.flat = torch.from_file(self.path, shared=True, size=need, dtype=torch.uint8)

    def slot(self, i: int) -> torch.Tensor:
        return self.flat[i * self.slot_bytes : (i + 1) * self.slot_bytes]  # [slot_bytes]

    def worker_info(self) -> dict:
        return {"path": self.path, "slot_bytes": self.slot_bytes}

    def close(self) -> None:
        self.flat = None
        if os.path.exists(self.path):
            os.unlink(self.path)


class ShmReceiver(Receiver):
    """The worker's end: the trainer's file mapped once, chunks read in place."""

    kind = "shm"

    def __init__(self, path: str, slot_bytes: int) -> None:
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"shared-memory weight slots {path} not found: is the trainer on this node?"
            )
        self.slot_bytes = slot_bytes
        self.flat = torch.from_file(path, shared=True, size=2 * slot_bytes, dtype=torch.uint8)

    def chunk(self, slot: int, nbytes: int) -> torch.Tensor:
        start = slot * self.slot_bytes
        return self.flat[start : start + nbytes]  # [nbytes]

    def close(self) -> None:
        self.flat = None
