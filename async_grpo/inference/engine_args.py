"""The settings a vLLM engine is started with: its process environment, the CPU
scheduler's, and LoRA serving."""

from __future__ import annotations

import os
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
            "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(cfg.kv_cache_gib))),
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
