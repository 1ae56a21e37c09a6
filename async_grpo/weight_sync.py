"""Weight sync: a torch.distributed group between trainer rank 0 and the inference workers.

Rank 0 is the trainer; workers (every tensor-parallel shard of every engine) take ranks
1..N. The group is built from its own TCPStore, so it never touches torchrun's default
group. gloo on CPU, NCCL on GPU: the same code. Tensors travel in flat per-dtype buckets
(one broadcast per bucket, not per tensor); both sides derive the buckets from the same
`metas` list, so only names and shapes cross Ray.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

BUCKET_BYTES = 32 << 20  # small enough to overlap casting with sending


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


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Consecutive runs of same-dtype tensors, each run at most `bucket_bytes` (or one tensor)."""
    buckets: list[list[int]] = []
    size = 0
    for i, m in enumerate(metas):
        nbytes = m.numel * getattr(torch, m.dtype).itemsize
        same = buckets and metas[buckets[-1][-1]].dtype == m.dtype
        if same and size + nbytes <= bucket_bytes:
            buckets[-1].append(i)
            size += nbytes
        else:
            buckets.append([i])
            size = nbytes
    return buckets


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

    def _start_broadcast(self, tensor: torch.Tensor) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.pg.broadcast([tensor], opts)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self._start_broadcast(tensor).wait()

    def send(
        self,
        named: list[tuple[str, torch.Tensor]],
        metas: list[TensorMeta],
        bucket_bytes: int = BUCKET_BYTES,
    ) -> int:
        """Rank 0: broadcast the tensors described by `metas`; returns bytes sent.

        Casting bucket k+1 overlaps the broadcast of bucket k (one broadcast in flight)."""
        sent = 0
        in_flight = None
        for bucket in plan_buckets(metas, bucket_bytes):
            dtype = getattr(torch, metas[bucket[0]].dtype)
            flat = torch.empty(
                sum(metas[i].numel for i in bucket), dtype=dtype, device=self.device
            )  # [sum numel]
            offset = 0
            for i in bucket:  # cast while copying: no per-tensor temporaries
                n = metas[i].numel
                flat[offset : offset + n].copy_(named[i][1].detach().reshape(-1))
                offset += n
            if in_flight is not None:
                in_flight[0].wait()
            in_flight = (self._start_broadcast(flat), flat)
            sent += flat.numel() * flat.element_size()
        if in_flight is not None:
            in_flight[0].wait()
        return sent

    def recv(
        self, metas: list[TensorMeta], bucket_bytes: int = BUCKET_BYTES
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Ranks > 0: receive every bucket; yields (name, tensor) in `metas` order."""
        for bucket in plan_buckets(metas, bucket_bytes):
            dtype = getattr(torch, metas[bucket[0]].dtype)
            flat = torch.empty(
                sum(metas[i].numel for i in bucket), dtype=dtype, device=self.device
            )  # [sum numel]
            self._broadcast(flat)
            offset = 0
            for i in bucket:
                m = metas[i]
                yield m.name, flat[offset : offset + m.numel].view(m.shape)
                offset += m.numel

    def close(self) -> None:
        self.pg = None
        self._store = None


def metas_for(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> list[TensorMeta]:
    """Describe tensors as they will travel (cast to `dtype`)."""
    return [TensorMeta(n, tuple(t.shape), str(dtype).removeprefix("torch.")) for n, t in named]
