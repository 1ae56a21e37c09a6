"""The interface of a push kind (see the package docstring)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class PushKind(ABC):
    """One kind of push. `name` goes on the wire. The worker-side methods take the
    generation worker (inference/generation.py) and run in its actor; the engine-side ones
    take our weight-transfer engine (inference/vllm_ext.py) and run in vLLM's worker
    process. The state a kind keeps between calls lives on those objects."""

    name: str

    def check_worker(self, worker: Any) -> None:
        """Refuse (RuntimeError) a worker that cannot take this kind of push; any worker
        takes most kinds."""
        return None

    # worker side -----------------------------------------------------------------------
    @abstractmethod
    async def begin(
        self, worker: Any, version: int, timeout_s: float, attempt: int, in_flight: bool
    ) -> float:
        """Open a push of `version`; returns the seconds spent pausing generation."""

    @abstractmethod
    async def end(self, worker: Any, version: int) -> None:
        """Close the push: the engine serves `version` from here on."""

    @abstractmethod
    async def load_folder(self, worker: Any, folder: str, version: int) -> None:
        """Serve a checkpoint folder of this kind as `version`."""

    # engine side (inside vLLM's worker process) ---------------------------------------
    @abstractmethod
    def start(self, ext: Any) -> None:
        """A push begins (`start_weight_update`)."""

    @abstractmethod
    def receive(self, ext: Any, tensors: list[tuple[str, Any]], flat: Any) -> None:
        """One chunk's tensors (views of `flat`, a slot the trainer reuses after)."""

    @abstractmethod
    def finish(self, ext: Any) -> None:
        """The push's last chunk is in (`finish_weight_update`)."""
