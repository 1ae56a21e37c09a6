"""Wire types between the batcher, the registries and the inference workers."""

from __future__ import annotations

from dataclasses import dataclass

# tells a CPU engine's worker process `generation.cpu_linear` (read by vllm_ext at import)
CPU_LINEAR_ENV = "ASYNC_GRPO_CPU_LINEAR"
# set (to anything): a CPU engine keeps vLLM's own LoRA ops (bench/lora_serving.py compares)
VLLM_LORA_OPS_ENV = "ASYNC_GRPO_VLLM_LORA_OPS"


class RequestError(Exception):
    """A request that fails by itself (bad input); the worker stays up and is not retried."""


class PoolUnavailable(Exception):
    """No worker could take the request: none registered, all dead, or it can never fit."""


@dataclass
class SamplingSettings:
    """Per-request sampling. `seed` makes a request reproducible (None: engine randomness)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # strings that end a completion (not in its text)


@dataclass
class Completion:
    """One sampled completion.

    Invariants: len(logprobs) == len(token_ids); logprobs[i] is the sampling log-prob of
    token_ids[i] under the weights of `token_versions[i]` (of `policy_version` when
    `token_versions` is None); `policy_version` is the oldest of them; finish_reason is
    "stop" or "length". Tokens of several versions come from an in-flight weight update.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    policy_version: int
    token_versions: list[int] | None = None


@dataclass
class WorkerStatus:
    """What a registry knows of one worker (`async-grpo status` prints these)."""

    worker_id: str
    pool: str
    capacity: int
    load: int
    version: int
    node: str
    seconds_since_heartbeat: float
    transport: str = ""  # how pushed weights reach it (broadcast, shm, cuda_ipc), once known


@dataclass(frozen=True)
class AdapterServing:
    """An engine that serves LoRA adapters (a run with `trainer.lora`, pushed as adapters):
    ranks up to `max_rank`, and `slots` adapters held at once (one per policy version a
    request may still be generating with)."""

    max_rank: int
    slots: int
