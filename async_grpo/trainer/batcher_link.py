"""The trainer's side of the batcher actor: create or find it, then pull items from it.

Rank 0 creates the named `ExperienceBatcher` actor and steers it (start, policy version,
stop); every rank pulls its own minibatches. `Trainer` talks only to this small class, so
tests drive a real `Trainer.step` with any object that has `next` and `set_version`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from async_grpo.batcher.types import EndOfBatch, Minibatch
from async_grpo.config import RunConfig

GET_TIMEOUT_S = 3600.0


class RemoteBatcher:
    """One rank's handle on the batcher actor; every call is bounded and says what it
    waited for."""

    def __init__(self, handle: Any, rank: int, timeout_s: float = GET_TIMEOUT_S) -> None:
        self.handle, self.rank, self.timeout_s = handle, rank, timeout_s

    def next(self) -> Minibatch | EndOfBatch:
        """This rank's next minibatch of the current step, then the step's EndOfBatch."""
        import ray

        ref = self.handle.get.remote(self.rank, self.timeout_s)
        return ray.get(ref, timeout=self.timeout_s + 60)

    def start(
        self,
        step: int,
        preloaded: dict[int, Any] | None = None,
        curriculum: dict[str, Any] | None = None,
    ) -> None:
        self._call("start", step, preloaded, curriculum)

    def curriculum_state(self, through: int) -> dict[str, Any] | None:
        """The curriculum's mastery table through step `through` (None: not drawn so)."""
        return self._call("curriculum_state", through)

    def wait_generated(self) -> None:
        """Until every step the current version allows is generated (before a push)."""
        self._call("wait_generated", self.timeout_s, timeout_s=self.timeout_s + 60)

    def pending(self, from_step: int) -> dict[int, Any]:
        """The generated, untrained groups of steps >= `from_step` (for a checkpoint)."""
        return self._call("pending", from_step)

    def score_failure_reasons(self, step: int) -> list[str]:
        return self._call("score_failure_reasons", step)

    def set_version(self, version: int) -> None:
        self._call("set_version", version)

    def stop(self) -> None:
        self._call("stop")

    def _call(self, method: str, *args: Any, timeout_s: float = 300.0) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            return ray.get(getattr(self.handle, method).remote(*args), timeout=timeout_s)
        except GetTimeoutError:
            raise TimeoutError(
                f"the batcher did not answer {method} within {timeout_s:.0f}s"
            ) from None


def setup_batcher(
    cfg: RunConfig, model_dir: str, rank: int, world: int, logs: Path | None = None
) -> RemoteBatcher:
    """Rank 0 creates the named batcher actor (its output in `logs`/batcher.log when
    given); the other ranks look it up."""
    import ray

    from async_grpo.batcher.batcher import ExperienceBatcher
    from async_grpo.data.tokenize import prepare_prompts
    from async_grpo.logs import actor_runtime_env
    from async_grpo.ray_utils import NAMESPACE

    name = f"batcher:{os.path.abspath(cfg.output_dir)}"
    if rank == 0:
        prompts = prepare_prompts(
            cfg.data, model_dir, cfg.generation.max_model_len, cfg.prompt_format
        )
        actor = ray.remote(ExperienceBatcher).options(
            name=name,
            namespace=NAMESPACE,
            num_cpus=0,
            max_concurrency=1000,
            runtime_env=actor_runtime_env(None, logs, "batcher"),
        )
        handle = actor.remote(cfg, prompts, world)
    dist.barrier()
    if rank != 0:
        handle = ray.get_actor(name, namespace=NAMESPACE)
    return RemoteBatcher(handle, rank)
