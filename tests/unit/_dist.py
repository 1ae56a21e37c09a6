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
