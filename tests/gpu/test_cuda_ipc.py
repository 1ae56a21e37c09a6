"""On CUDA (skipped elsewhere): the CUDA IPC transport between two processes on one GPU.

The trainer's end (`CudaSlots`) streams chunks of a model through its two slots with the
protocol of trainer/push.py; another process opens them with `IpcReceiver` and rebuilds
every tensor with `unpack`, the calls our vLLM engine makes (vllm_ext.py, tested on CPU
through shared memory). Every tensor arrives bit-exact, so no slot was overwritten before
it was read. The two ends are the ones `bench/weight_sync.py --gpu` times.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytestmark = pytest.mark.gpu


def test_chunks_cross_processes_on_one_gpu_bit_exact():
    from weight_sync import digest, ipc_push, ipc_receiver

    from async_grpo.transports.base import TensorMeta, plan_chunks, slot_bytes
    from async_grpo.transports.cuda_ipc import CudaSlots

    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [("model.embed_tokens.weight", (1000, 64))]
    for i in range(6):
        shapes += [(f"model.layers.{i}.mlp.weight", (256, 64)), (f"model.layers.{i}.norm", (64,))]
    metas = [TensorMeta(n, s, "bfloat16") for n, s in shapes]
    weights = [torch.randn(m.shape, device="cuda", generator=gen).to(torch.bfloat16) for m in metas]
    chunks = plan_chunks(metas, limit=40_000)  # several chunks: both slots reused
    assert len(chunks) > 3
    slots = CudaSlots(slot_bytes(metas, chunks))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=ipc_receiver, args=(child,))
    proc.start()
    parent.send((slots.worker_info(), metas))
    for _ in range(2):  # slots reused across pushes
        ipc_push(parent, slots, metas, weights, chunks)
    parent.send(None)
    got = parent.recv()
    proc.join(timeout=60)
    assert proc.exitcode == 0
    for m, w in zip(metas, weights, strict=True):
        assert got[m.name] == digest(w), m.name
