"""The settings a vLLM engine is started with: its process environment, the CPU
scheduler's, and LoRA serving."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from async_grpo.config import GenerationConfig
from async_grpo.inference.types import CPU_LINEAR_ENV, VLLM_LORA_OPS_ENV, AdapterServing


def vllm_env(cfg: GenerationConfig, device: str) -> dict[str, str]:
    """Environment for an engine process (set through the actor's runtime_env)."""
    env = {"VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", str(Path.home() / ".cache/vllm"))}
    if os.environ.get(VLLM_LORA_OPS_ENV):
        env[VLLM_LORA_OPS_ENV] = os.environ[VLLM_LORA_OPS_ENV]
    if device == "cpu":
        # with generation.cpus our binding holds the whole process (placement.py), not vLLM's
        bind = "nobind" if cfg.cpus else os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env |= {
            "VLLM_CPU_OMP_THREADS_BIND": bind,
            "OMP_NUM_THREADS": str(cfg.threads),
            CPU_LINEAR_ENV: cfg.cpu_linear,
            # unbound threads: the model runs in the engine-core process instead of a
            # worker process of its own (faster start and decoding, docs/engine-processes.md);
            # vLLM binds threads only in its worker process
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if bind == "nobind" else "1",
        }
    return env


def cpu_scheduler_args(cfg: GenerationConfig, device: str) -> dict[str, Any]:
    """On CPU, prefill whole prompts (no chunked prefill).

    vLLM rewinds a seeded request's random generator when it discards the token sampled
    after a partial prefill chunk; CPU torch generators have no offset, so the engine dies
    ("CPU Generator does not use offset"). Without chunked prefill no sample is discarded.
    See docs/vllm-cpu.md.
    """
    if device != "cpu":
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(cfg.max_model_len, 4096)}


def cpu_kv_cache_args(cfg: GenerationConfig, device: str) -> dict[str, Any]:
    """On CPU, a KV cache of exactly `kv_cache_gib` (vLLM's own variable takes whole GiB: a
    tiny model's engine zeroed 1 GiB it never used, about 0.4 CPU s of page faults alone,
    several seconds on a loaded machine). An explicit size also keeps vLLM from a warm-up
    forward of `max_num_batched_tokens` that it runs to measure memory otherwise. vLLM's
    variable `VLLM_CPU_KVCACHE_SPACE` wins over the argument, so it is removed from this
    process (the worker's, where vLLM reads it), should the user's shell have set it."""
    if device != "cpu":
        return {}
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return {"kv_cache_memory_bytes": int(cfg.kv_cache_gib * (1 << 30))}


def lora_engine_args(adapters: AdapterServing | None) -> dict[str, Any]:
    """vLLM's LoRA settings: the smallest rank it serves that holds ours, and a slot (in a
    batch, and in its cache) for every version a request may still be using, so no adapter
    in use is evicted."""
    if adapters is None:
        return {}
    ranks = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks
    rank = next(r for r in ranks if r >= adapters.max_rank)
    return {
        "enable_lora": True,
        "max_lora_rank": rank,
        "max_loras": adapters.slots,
        "max_cpu_loras": adapters.slots,
    }


# sockets a forked engine core closes: those its worker had open before the engine was
# built (Ray's), and the worker's pid. Set only while the engine starts; the at-fork hook
# is registered once.
_INHERITED: dict[int, int] = {}
_WORKER: list[int] = []
_HOOKED: list[bool] = []
PR_SET_PDEATHSIG = 1  # prctl: the signal this process gets when its parent ends
PR_SET_NAME = 15  # prctl: the process's short name (15 bytes)


@contextmanager
def forked_engine_core(device: str) -> Iterator[None]:
    """On CPU, vLLM's engine-core process is forked from the worker, not spawned.

    vLLM spawns it in any Ray actor (`vllm.utils.system_utils._maybe_force_spawn`), so the
    new process imports vLLM and torch again: most of an engine start's CPU on 2 cores
    (docs/engine-processes.md). The worker has imported them already; a fork shares them.
    The fork copies the actor's sockets to Ray (its raylet, its gRPC server, the GCS): the
    child closes those, so an actor that dies is seen dead at once, not when its engine
    ends. The child also copies the state of the actor's other threads (Ray's), locks held
    included, and its shutdown may hang on one of them: so the kernel SIGKILLs it the
    moment its actor ends (the fork runs on the actor's event-loop thread, which lives as
    long as the actor), whatever a SIGTERM from Ray, which can come a moment earlier, has
    started. GPU workers keep vLLM's spawn (CUDA cannot be forked)."""
    if device != "cpu":
        yield
        return
    import vllm.v1.engine.utils as engine_utils

    if not _HOOKED:
        os.register_at_fork(after_in_child=_in_forked_core)
        _HOOKED.append(True)
    _INHERITED.update(_sockets())
    _WORKER[:] = [os.getpid()]
    spawning = engine_utils.get_mp_context
    engine_utils.get_mp_context = lambda: multiprocessing.get_context("fork")
    try:
        yield
    finally:
        engine_utils.get_mp_context = spawning
        _INHERITED.clear()
        _WORKER.clear()


def _in_forked_core() -> None:
    """In a child just forked: end with the worker, close its sockets to Ray, and take
    vLLM's name for the engine core (nothing outside an engine's start)."""
    if not _INHERITED:
        return
    libc = ctypes.CDLL(None)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != _WORKER[0]:  # the worker ended before the line above
        os._exit(1)
    now = _sockets()
    for fd, inode in _INHERITED.items():
        if now.get(fd) == inode:
            os.close(fd)
    _INHERITED.clear()
    _WORKER.clear()
    # vLLM names its engine core with the setproctitle package, which cannot rename a
    # process Ray has renamed: its command line through Ray's own call, its short name
    # (what psutil, top and the OOM killer's log show) through the kernel
    title = f"{os.environ.get('VLLM_PROCESS_NAME_PREFIX', 'VLLM')}::EngineCore"
    raylet = sys.modules.get("ray._raylet")
    if raylet is not None:
        raylet.setproctitle(title)
    libc.prctl(PR_SET_NAME, title.encode()[:15], 0, 0, 0)


def _sockets() -> dict[int, int]:
    """fd -> inode of this process's open sockets."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the listing's own descriptor, or one closed meanwhile
        if target.startswith("socket:["):
            out[int(name)] = int(target[8:-1])
    return out
