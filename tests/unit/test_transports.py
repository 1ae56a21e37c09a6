"""Weight transports without Ray or vLLM: chunk plans, packing, the choice per worker,
shared-memory slots seen from a second mapping."""

import pytest
import torch

from async_grpo.transports.base import (
    TensorMeta,
    chunk_bytes,
    layer_key,
    pack,
    plan_chunks,
    slot_bytes,
    unpack,
)
from async_grpo.transports.select import Place, choose_transport

METAS = [
    TensorMeta("model.embed_tokens.weight", (100, 8), "float32"),  # 3,200 bytes
    TensorMeta("model.layers.0.q.weight", (8, 8), "float32"),  # 256
    TensorMeta("model.layers.0.norm", (8,), "float32"),  # 32 -> 64 aligned
    TensorMeta("model.layers.1.q.weight", (8, 8), "float32"),
    TensorMeta("model.layers.1.norm", (8,), "float32"),
    TensorMeta("model.layers.10.q.weight", (8, 8), "float32"),
    TensorMeta("model.norm.weight", (8,), "float32"),
    TensorMeta("lm_head.weight", (100, 8), "float32"),
]


def test_layer_key_stops_at_the_first_index():
    assert layer_key("model.layers.3.mlp.up.weight") == "model.layers.3"
    assert layer_key("model.layers.30.x") != layer_key("model.layers.3.x")
    assert layer_key("model.embed_tokens.weight") == ""


def test_chunks_hold_whole_layers_within_the_limit():
    # embed 3,200 B; each layer 256 + 64 = 320 B; layer 10 256 B; tail 64 + 3,200 B
    chunks = plan_chunks(METAS, limit=700)
    assert chunks == [[0], [1, 2, 3, 4], [5], [6, 7]]
    assert [chunk_bytes(METAS, c) for c in chunks] == [3200, 640, 256, 3264]
    assert slot_bytes(METAS, chunks) == 3264  # one group above the limit is a chunk alone
    assert plan_chunks(METAS, limit=1 << 20) == [list(range(len(METAS)))]
    for c in plan_chunks(METAS, limit=1):  # never splits a layer
        assert len({layer_key(METAS[i].name) for i in c}) == 1


def test_pack_then_unpack_is_exact_and_casts_once():
    metas = [
        TensorMeta("a", (3, 5), "bfloat16"),
        TensorMeta("b", (7,), "float32"),
        TensorMeta("c", (2, 2), "bfloat16"),
    ]
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(m.shape, generator=gen) for m in metas]  # fp32 masters
    slot = torch.zeros(1024, dtype=torch.uint8)
    used = pack(slot, metas, tensors)
    assert used == 64 + 64 + 64  # 30, 28 and 8 bytes, each on a 64-byte boundary
    out = unpack(slot, metas)
    for (name, view), m, t in zip(out, metas, tensors, strict=True):
        assert name == m.name and view.dtype == getattr(torch, m.dtype)
        assert torch.equal(view, t.to(view.dtype))
        assert view.untyped_storage().data_ptr() == slot.untyped_storage().data_ptr()  # no copy


CPU_A, CPU_B = Place("node-a", "cpu"), Place("node-b", "cpu")


@pytest.mark.parametrize(
    "forced, trainer, worker, expected",
    [
        ("auto", CPU_A, Place("node-a", "cpu"), "shm"),
        ("auto", CPU_A, CPU_B, "broadcast"),
        ("auto", Place("a", "GPU-1"), Place("a", "GPU-1"), "cuda_ipc"),
        ("auto", Place("a", "GPU-1"), Place("a", "GPU-2"), "broadcast"),
        ("auto", Place("a", "GPU-1"), Place("a", "cpu"), "broadcast"),
        ("auto", CPU_A, Place("node-a", "cpu", broadcast_only=True), "broadcast"),
        ("broadcast", CPU_A, Place("node-a", "cpu"), "broadcast"),
        ("shm", CPU_A, Place("node-a", "cpu"), "shm"),
    ],
)
def test_transport_choice(forced, trainer, worker, expected):
    assert choose_transport(forced, trainer, worker)[0] == expected


def test_a_forced_transport_the_placement_cannot_use_is_an_error():
    with pytest.raises(ValueError, match="'shm' needs the worker on the trainer's node"):
        choose_transport("shm", CPU_A, CPU_B)
    with pytest.raises(ValueError, match="'cuda_ipc' needs the worker on the trainer's GPU"):
        choose_transport("cuda_ipc", CPU_A, Place("node-a", "cpu"))
    with pytest.raises(ValueError, match="must be one of"):
        choose_transport("rdma", CPU_A, CPU_A)


def _read_in_another_process(path: str, slot_bytes: int) -> list[int]:
    import json
    import subprocess
    import sys

    code = (
        "import json\n"
        "from async_grpo.transports.shm import ShmReceiver\n"
        f"r = ShmReceiver({path!r}, {slot_bytes})\n"
        "print(json.dumps(r.chunk(1, 8).tolist()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_shared_slots_are_seen_by_another_process_and_removed_on_close():
    import os
    import stat

    from async_grpo.transports.shm import SharedSlots

    slots = SharedSlots(64)
    assert stat.S_IMODE(os.stat(slots.path).st_mode) == 0o600  # the owner's alone
    slots.slot(1)[:8] = torch.arange(8, dtype=torch.uint8)
    assert _read_in_another_process(slots.path, 64) == list(range(8))
    slots.slot(1)[:8] = 7  # reused in place: a reader sees the new bytes
    assert _read_in_another_process(slots.path, 64) == [7] * 8
    slots.close()
    assert not os.path.exists(slots.path)


def test_shared_slots_refuse_a_full_shm_with_one_line(monkeypatch):
    from async_grpo.transports import shm

    monkeypatch.setattr(shm, "shm_room", lambda directory=shm.SHM_DIR: 10 << 20)
    with pytest.raises(OSError, match=r"has 10 MiB free; shared-memory weight slots need 64 MiB"):
        shm.SharedSlots(32 << 20)


_MEMBER = """
import os, signal, sys, time
import torch
from async_grpo.transports.broadcast import WeightSyncGroup
rank, port = int(sys.argv[1]), int(sys.argv[2])
group = WeightSyncGroup("127.0.0.1", port, rank, 3, "gloo", timeout_s=120)
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # dies in the group, before the broadcast
t = torch.zeros(1 << 20)
start = time.monotonic()
try:
    group.broadcast(t).wait()
    print("received", t[0].item(), flush=True)
except RuntimeError:
    print(f"failed after {time.monotonic() - start:.1f}s", flush=True)
"""


def test_a_member_blocked_by_a_broken_broadcast_fails_once_rank_0_closes_the_group():
    """Rank 1 dies; rank 0's broadcast fails at its first send, before rank 2 got a byte, and
    rank 2 would wait out the group's 120 s timeout. The pusher relies on this: dropping
    the failed broadcast and closing the group closes rank 0's connections, and rank 2's
    receive fails at once."""
    import subprocess
    import sys
    import time

    from async_grpo.trainer.push import _free_port
    from async_grpo.transports.broadcast import WeightSyncGroup

    port = _free_port()
    members = [
        subprocess.Popen(
            [sys.executable, "-c", _MEMBER, str(r), str(port)], stdout=subprocess.PIPE, text=True
        )
        for r in (1, 2)
    ]
    try:
        group = WeightSyncGroup("127.0.0.1", port, 0, 3, "gloo", timeout_s=120)
        assert members[0].wait(timeout=60) == -9  # rank 1 is gone
        t = torch.ones(1 << 20)
        work = group.broadcast(t)
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            work.wait()
        time.sleep(3.0)  # rank 2 stays blocked meanwhile
        assert members[1].poll() is None
        del work  # the failed broadcast holds the group's connections open too
        group.close()
        out, _ = members[1].communicate(timeout=30)  # well inside the group's timeout
        assert out.startswith("failed after "), out
        assert float(out.split()[2].rstrip("s")) < 30
    finally:
        for m in members:
            m.kill()
