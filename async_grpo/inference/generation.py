"""GenerationWorker: one vLLM V1 `AsyncLLM` engine behind a Ray actor.

In: prompt token ids, a group size n, sampling settings; new weights (a torch.distributed
broadcast from trainer rank 0, or a state dict). Out: `Completion`s with per-token sampling
log-probs and the policy version. Many requests run at once (continuous batching).

Version rule: a completion carries the version of the weights when its request started. A
request that spans an update mixes two policies; stamping the older version keeps the
staleness bound conservative.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

from async_grpo.config import GenerationConfig
from async_grpo.inference.types import Completion, RequestError, SamplingSettings
from async_grpo.inference.worker_base import RegisteredWorker


def vllm_env(cfg: GenerationConfig, device: str) -> dict[str, str]:
    """Environment for an engine process (set through the actor's runtime_env)."""
    env = {"VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", str(Path.home() / ".cache/vllm"))}
    if device == "cpu":
        env |= {
            "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(cfg.kv_cache_gib))),
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
            "OMP_NUM_THREADS": str(cfg.threads),
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


class GenerationWorker(RegisteredWorker):
    """A vLLM engine that serves many `generate` calls at once and accepts weight updates."""

    pool = "generation"

    def __init__(
        self,
        model_dir: str,
        cfg: GenerationConfig,
        worker_id: str | None = None,
        device: str = "cpu",
    ) -> None:
        super().__init__(worker_id or f"gen-{uuid.uuid4().hex[:6]}", cfg.max_concurrent_seqs)
        self.model_dir, self.cfg, self.device = model_dir, cfg, device
        self.engine: Any = None
        self._update_lock = asyncio.Lock()
        self.requests_served = 0

    async def start(self, register: bool = True) -> str:
        """Build the engine (tens of seconds on CPU), then register with the pool's registry."""
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from async_grpo.models import in_dtype
        from async_grpo.precision import resolve_dtype

        c = self.cfg
        precision = resolve_dtype(c.dtype, self.device)
        self.dtype = precision.dtype
        print(f"{self.worker_id}: vLLM computes in {precision.describe()}", flush=True)
        # the weights stored in the engine's dtype: loaded as they are, no cast per tensor
        model = await asyncio.to_thread(in_dtype, self.model_dir, precision.dtype)
        args = AsyncEngineArgs(
            model=str(model),
            dtype=precision.dtype,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_concurrent_seqs,
            enforce_eager=c.enforce_eager,
            seed=c.seed,
            tensor_parallel_size=c.tensor_parallel_size,
            gpu_memory_utilization=c.gpu_memory_utilization,
            logprobs_mode="processed_logprobs",  # log-probs after temperature, as the trainer computes
            worker_extension_cls="async_grpo.inference.vllm_ext.WeightSyncExtension",
            disable_log_stats=True,
            **cpu_scheduler_args(c, self.device),
        )
        self.engine = AsyncLLM.from_engine_args(args)
        if register:
            await self.register()
        return self.worker_id

    async def generate(
        self, prompt_ids: list[int], n: int, sampling: SamplingSettings | None = None
    ) -> list[Completion]:
        """`n` completions of one prompt, each with per-token log-probs."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        s = sampling or SamplingSettings(
            self.cfg.max_new_tokens, self.cfg.temperature, self.cfg.top_p
        )
        room = self.cfg.max_model_len - len(prompt_ids)
        if room < 1:
            raise RequestError(
                f"{self.worker_id}: prompt of {len(prompt_ids)} tokens leaves no room in"
                f" max_model_len={self.cfg.max_model_len}"
            )
        params = SamplingParams(
            n=n,
            max_tokens=min(s.max_new_tokens, room),
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        version = self.version
        self.in_flight += n
        # a caller that gives up cancels this call (ray.cancel): the CancelledError raised
        # here makes vLLM abort the request, so no ghost work keeps the engine busy
        try:
            final = None
            async for out in self.engine.generate(
                TokensPrompt(prompt_token_ids=prompt_ids), params, request_id=uuid.uuid4().hex
            ):
                final = out
        except ValueError as e:  # vLLM's input validation: this request alone is bad
            raise RequestError(f"{self.worker_id}: request refused by vLLM: {e}") from None
        finally:
            self.in_flight -= n
        self.requests_served += 1
        return [
            Completion(
                list(o.token_ids),
                [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs, strict=True)],
                o.text,
                "length" if o.finish_reason == "length" else "stop",
                version,
            )
            for o in final.outputs
        ]

    async def ping(self) -> dict[str, Any]:
        """The base fields, plus the requests the engine still runs (aborts included)."""
        running = self.engine.get_num_unfinished_requests() if self.engine is not None else 0
        return await super().ping() | {"engine_requests": running}

    async def init_weight_sync(
        self,
        host: str,
        port: int,
        rank_offset: int,
        world_size: int,
        backend: str,
        timeout_s: float,
    ) -> list[int]:
        """Join the trainer's weight-sync group; every TP shard takes its own rank."""
        return await self.engine.collective_rpc(
            "async_grpo_init_sync", args=(host, port, rank_offset, world_size, backend, timeout_s)
        )

    def group_size(self) -> int:
        return self.cfg.tensor_parallel_size

    async def receive_weights(
        self, metas: list[tuple[str, tuple[int, ...], str]], version: int
    ) -> int:
        """Take part in one broadcast from trainer rank 0, then serve the new version."""
        async with self._update_lock:
            await self.engine.collective_rpc("async_grpo_receive", args=(metas,))
            await self._after_update(version)
        return self.version

    async def update_weights_from_state_dict(
        self, state: dict[str, torch.Tensor] | list[Any], version: int
    ) -> int:
        """Load weights from a state dict (or a one-element list holding its ObjectRef)."""
        from safetensors.torch import save_file

        if isinstance(state, list):
            import ray

            state = await state[0] if isinstance(state[0], ray.ObjectRef) else state[0]
        async with self._update_lock:
            with tempfile.TemporaryDirectory(prefix="async-grpo-weights-") as d:
                tensors = {k: v.detach().contiguous() for k, v in state.items()}
                save_file(tensors, os.path.join(d, "model.safetensors"))
                await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": d})
            await self._after_update(version)
        return self.version

    async def _after_update(self, version: int) -> None:
        await self.engine.reset_prefix_cache()
        self.version = version

    async def stop(self, drain_timeout_s: float = 30.0) -> dict[str, int]:
        """Deregister, let running requests finish (up to the timeout), shut the engine."""
        result = await self.drain(drain_timeout_s)
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        return result
