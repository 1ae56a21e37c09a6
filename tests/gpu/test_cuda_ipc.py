"""On CUDA (skipped elsewhere): the CUDA IPC transport between two processes on one GPU.

The trainer's end (`CudaSlots`) streams chunks of a model through its two slots with the
protocol of trainer/push.py; another process opens them with `IpcReceiver` and rebuilds
every tensor with `unpack`, the calls our vLLM engine makes (vllm_ext.py, tested on CPU
through shared memory). Every tensor arrives bit-exact, so no slot was overwritten before
it was read. The two ends are the ones `bench/weight_sync.py --gpu` times.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytestmark = pytest.mark.gpu


def test_chunks_cross_processes_on_one_gpu_bit_exact():
    from weight_sync import digest, ipc_round_trip

    from async_grpo.transports.base import TensorMeta, plan_chunks

    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [("model.embed_tokens.weight", (1000, 64))]
    for i in range(6):
        shapes += [(f"model.layers.{i}.mlp.weight", (256, 64)), (f"model.layers.{i}.norm", (64,))]
    metas = [TensorMeta(n, s, "bfloat16") for n, s in shapes]
    weights = [torch.randn(m.shape, device="cuda", generator=gen).to(torch.bfloat16) for m in metas]
    chunks = plan_chunks(metas, limit=40_000)  # several chunks: both slots reused
    assert len(chunks) > 3
    got, _ = ipc_round_trip(metas, weights, chunks, pushes=2)  # slots reused across pushes
    for m, w in zip(metas, weights, strict=True):
        assert got[m.name] == digest(w), m.name
