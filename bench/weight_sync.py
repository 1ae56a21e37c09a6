"""Weight push seconds per transport, against a raw copy of the same bytes.

    .venv/bin/python bench/weight_sync.py [--pushes 5]          # CPU: shm vs gloo, SmolLM2-135M
    .venv/bin/python bench/weight_sync.py --cpu-linear torch    # the same, plain linear layers
    python bench/weight_sync.py --gpu                            # CUDA IPC, Qwen2.5-1.5B shapes

CPU: one real vLLM-CPU engine (dtype `auto`, as a run uses) on a local Ray cluster; this
process is trainer rank 0 (`WeightPusher` over the model, unsharded). Each push is timed
from the pause to the engine's acknowledgement that vLLM has loaded the weights. Raw
figures: one memcpy of the pushed bytes (shm), one gloo broadcast of them to another
process (broadcast). Goal: the shared-memory push takes <= 0.5x the gloo push.

GPU (no vLLM needed): two processes on one GPU; the trainer streams a Qwen2.5-1.5B-shaped
bf16 model (3.1 GB) through the two IPC slots and the receiver copies every chunk into
its own tensors, as vLLM's loader does. Goal: <= 0.2 s per push.

Prints one JSON line per figure (with the CPU kind or the GPU name).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _emit(**fields: object) -> None:
    import torch

    fields["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    print(json.dumps(fields), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raw_receiver(port: int, nbytes: int) -> None:
    import torch

    from async_grpo.transports.broadcast import WeightSyncGroup

    group = WeightSyncGroup("127.0.0.1", port, 1, 2, "gloo", 120)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(3):
        group.broadcast(buf).wait()


def raw_broadcast_s(nbytes: int) -> float:
    """One gloo broadcast of `nbytes` to another process (best of two, after a warm-up)."""
    import multiprocessing as mp

    import torch

    from async_grpo.transports.broadcast import WeightSyncGroup

    port = _free_port()
    proc = mp.get_context("spawn").Process(target=_raw_receiver, args=(port, nbytes))
    proc.start()
    group = WeightSyncGroup("127.0.0.1", port, 0, 2, "gloo", 120)
    flat = torch.ones(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        group.broadcast(flat).wait()
        times.append(time.perf_counter() - t)
    proc.join(timeout=120)
    return min(times[1:])


def _peak_rss_mib(reset: bool = False) -> float:
    """This process's peak resident memory (VmHWM); `reset` starts a new peak (Linux)."""
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    with open("/proc/self/status") as f:
        hwm = next(line for line in f if line.startswith("VmHWM:"))
    return int(hwm.split()[1]) / 1024  # kB


def raw_copy_s(nbytes: int) -> float:
    import torch

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    t = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t


def cpu_figures(pushes: int, cpu_linear: str) -> None:
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from async_grpo.config import GenerationConfig
    from async_grpo.models import resolve_model
    from async_grpo.pools import start_generation_workers, stop_workers
    from async_grpo.ray_utils import connect
    from async_grpo.trainer.push import WeightPusher

    torch.set_num_threads(1)
    model_dir = resolve_model("smollm2-135m")
    connect(None, num_cpus=4, object_store_bytes=256 << 20)
    cfg = GenerationConfig(
        max_model_len=256, max_concurrent_seqs=8, kv_cache_gib=1, threads=1, cpu_linear=cpu_linear
    )
    (worker,) = start_generation_workers(str(model_dir), cfg, 1)
    policy = torch.nn.Module()
    policy.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dtype = ray.get(worker.ping.remote())["dtype"]
    with torch.no_grad():  # transformers maps the file: make the model resident before measuring
        sum(float(p.sum()) for p in policy.parameters())
    try:
        for transport in ("shm", "broadcast"):
            pusher = WeightPusher(policy, rank=0, transport=transport, timeout_s=300)
            peak = _peak_rss_mib(reset=True)
            pusher.push(1)  # connect, first touch of the slots
            runs = [pusher.push(2 + i) for i in range(pushes)]
            growth = _peak_rss_mib() - peak
            slots_mib = 2 * pusher.slots.slot_bytes / 2**20
            pusher.close()
            nbytes = int(runs[0]["weight_push_bytes"])
            raw = raw_copy_s(nbytes) if transport == "shm" else raw_broadcast_s(nbytes)
            push_s = statistics.median(r["time/weight_push"] for r in runs)
            _emit(
                figure=f"weight push, {transport}",
                model="SmolLM2-135M",
                wire_dtype=dtype,
                cpu_linear=cpu_linear,
                bytes=nbytes,
                push_s=round(push_s, 3),
                stream_s=round(statistics.median(r["time/weight_stream"] for r in runs), 3),
                raw_s=round(raw, 3),
                raw_what="one memcpy" if transport == "shm" else "one gloo broadcast",
                pushes=pushes,
                rank0_peak_growth_mib=round(growth),
                slots_mib=round(slots_mib),
            )
    finally:
        stop_workers([worker], drain_timeout_s=5)
        ray.shutdown()


def _qwen15b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2.5-1.5B's tensors (hidden 1536, 28 layers, 12 heads / 2 KV heads, MLP 8960)."""
    h, kv, mlp, vocab = 1536, 256, 8960, 151936
    shapes = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(28):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.q_proj.bias", (h,)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (mlp, h)),
            (p + "mlp.up_proj.weight", (mlp, h)),
            (p + "mlp.down_proj.weight", (h, mlp)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    return shapes + [("model.norm.weight", (h,))]


def digest(t) -> str:  # noqa: ANN001 - a tensor on any device
    """A tensor's bytes, hashed (bit-exact comparison across processes)."""
    import hashlib

    import torch

    raw = t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def ipc_receiver(conn) -> None:  # noqa: ANN001 - a multiprocessing Connection
    """A worker's end over a pipe: open the slots once, copy each announced chunk into its
    own tensors (as vLLM's loader does), acknowledge it; at the end send every digest."""
    import torch

    from async_grpo.transports.base import unpack
    from async_grpo.transports.cuda_ipc import IpcReceiver

    info, metas = conn.recv()
    receiver = IpcReceiver(info["handle"], info["slot_bytes"])
    model = {
        m.name: torch.empty(m.shape, dtype=getattr(torch, m.dtype), device="cuda") for m in metas
    }
    while (msg := conn.recv()) is not None:
        slot, nbytes, chunk = msg
        for name, view in unpack(receiver.chunk(slot, nbytes), [metas[i] for i in chunk]):
            model[name].copy_(view)
        torch.cuda.synchronize()
        conn.send("loaded")
    conn.send({name: digest(t) for name, t in model.items()})


def ipc_push(conn, slots, metas, weights, chunks) -> None:  # noqa: ANN001
    """The trainer's end of one push: chunk k goes to slot k % 2, which is reused once the
    receiver has acknowledged chunk k - 2 (the protocol of trainer/push.py)."""
    import torch

    from async_grpo.transports.base import view_at

    waiting: list[int] = []
    for k, chunk in enumerate(chunks):
        if len(waiting) == 2:
            assert conn.recv() == "loaded"
            waiting.pop(0)
        slot, offset = slots.slot(k % 2), 0
        for i in chunk:
            dst, offset = view_at(slot, offset, metas[i])
            dst.copy_(weights[i])
        torch.cuda.current_stream().synchronize()
        conn.send((k % 2, offset, chunk))
        waiting.append(k)
    for _ in waiting:
        assert conn.recv() == "loaded"


def ipc_round_trip(metas, weights, chunks, pushes: int) -> tuple[dict[str, str], list[float]]:  # noqa: ANN001
    """`pushes` pushes of `weights` (in `chunks`) into a fresh process by CUDA IPC: the
    digests of what it holds after the last one, and each push's seconds."""
    import multiprocessing as mp

    import torch

    from async_grpo.transports.base import slot_bytes
    from async_grpo.transports.cuda_ipc import CudaSlots

    slots = CudaSlots(slot_bytes(metas, chunks))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=ipc_receiver, args=(child,))
    proc.start()
    parent.send((slots.worker_info(), metas))
    times = []
    for _ in range(pushes):  # the slots reused by each next push
        torch.cuda.synchronize()
        t = time.perf_counter()
        ipc_push(parent, slots, metas, weights, chunks)
        times.append(time.perf_counter() - t)
    parent.send(None)
    if not parent.poll(120):
        raise TimeoutError("the receiving process sent no digests within 120 s")
    got = parent.recv()
    proc.join(timeout=120)
    if proc.exitcode != 0:
        raise RuntimeError(f"the receiving process ended with exit code {proc.exitcode}")
    return got, times


def gpu_figure(pushes: int) -> None:
    import torch

    from async_grpo.transports.base import TensorMeta, plan_chunks

    metas = [TensorMeta(n, s, "bfloat16") for n, s in _qwen15b_shapes()]
    weights = [torch.randn(m.shape, device="cuda").to(torch.bfloat16) for m in metas]
    got, times = ipc_round_trip(metas, weights, plan_chunks(metas), pushes + 1)
    assert all(got[m.name] == digest(w) for m, w in zip(metas, weights, strict=True))
    nbytes = sum(m.nbytes for m in metas)
    raw = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src = torch.ones_like(raw)
    torch.cuda.synchronize()
    t = time.perf_counter()
    raw.copy_(src)
    torch.cuda.synchronize()
    _emit(
        figure="weight push, cuda_ipc",
        model="Qwen2.5-1.5B shapes",
        gpu=torch.cuda.get_device_name(),
        bytes=nbytes,
        push_s=round(statistics.median(times[1:]), 3),
        raw_s=round(time.perf_counter() - t, 4),
        raw_what="one device-to-device copy",
        pushes=pushes,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--gpu", action="store_true", help="the CUDA IPC figure (needs CUDA)")
    parser.add_argument(
        "--cpu-linear",
        choices=["onednn", "torch"],
        default="onednn",
        help="the engine's generation.cpu_linear (docs/weight-sync.md)",
    )
    args = parser.parse_args()
    if args.gpu:
        gpu_figure(args.pushes)
    else:
        cpu_figures(args.pushes, args.cpu_linear)


if __name__ == "__main__":
    main()
