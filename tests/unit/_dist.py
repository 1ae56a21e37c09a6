"""A one-process torch.distributed default group for tests (gloo, or gloo+NCCL on CUDA)."""

from __future__ import annotations

import contextlib
import datetime
import socket
from collections.abc import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def one_rank_group(backend: str = "gloo", timeout_s: float = 60.0) -> Iterator[None]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _two_rank_worker(rank: int, port: int, fn: object, args: tuple) -> None:
    import os

    import torch

    from async_grpo.trainer.setup import process_group_backend

    torch.set_num_threads(1)
    dist.init_process_group(
        process_group_backend("cpu"),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        fn(rank, *args)
        dist.barrier()  # both ranks are done with every collective
    finally:
        dist.destroy_process_group()
    os._exit(0)  # gloo's threads can abort a normal interpreter exit after the teardown


def run_two_ranks(fn: object, *args: object) -> None:
    """`fn(rank, *args)` in two spawned processes on one CPU (gloo) group; `fn` must be a
    module-level function."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_two_rank_worker, args=(port, fn, args), nprocs=2, join=True)
