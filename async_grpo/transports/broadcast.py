"""Broadcast transport: a torch.distributed group between trainer rank 0 and workers.

Rank 0 is the trainer; workers (every tensor-parallel shard of every engine) take ranks
1..N. The group is built from its own TCPStore, so it never touches torchrun's default
group. gloo on CPU, NCCL on GPU: the same code. Reaches workers on any node.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from async_grpo.transports.base import Receiver


class WeightSyncGroup:
    """One member of the weight-sync group. Rank 0 hosts the store and sends."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 120.0,
    ) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        store = dist.TCPStore(
            host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
        )
        self._store = store  # keep the server alive on rank 0
        prefixed = dist.PrefixStore("async_grpo_weights", store)
        if backend == "gloo":
            self.device = torch.device("cpu")
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        elif backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:
            raise ValueError(f"weight sync backend must be gloo or nccl, got {backend!r}")

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        """Start a broadcast of `tensor` from rank 0 (in place on the others)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.pg.broadcast([tensor], opts)

    def close(self) -> None:
        """Drop this member's group. Its connections close once no Work of a broadcast is
        left either, and a member blocked receiving from it then fails at once instead of
        at the group's timeout (gloo has no abort that closes them)."""
        self.pg = None
        self._store = None


class BroadcastReceiver(Receiver):
    """A worker in the group: each chunk is received into one reused buffer."""

    kind = "broadcast"

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        slot_bytes: int,
    ) -> None:
        self.group = WeightSyncGroup(host, port, rank, world_size, backend, timeout_s)
        self.buf = torch.empty(slot_bytes, dtype=torch.uint8, device=self.group.device)

    def chunk(self, slot: int, nbytes: int) -> torch.Tensor:
        view = self.buf[:nbytes]  # [nbytes]
        self.group.broadcast(view).wait()
        return view

    def close(self) -> None:
        self.group.close()
        self.buf = None
