"""The interface every metrics sink implements, and the warning line they share."""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from typing import Any

INSTALL_HINT = "pip install 'async-grpo[trackers]'"


def warn(message: str) -> None:
    """One `async-grpo: warning: ...` line on stderr."""
    print(f"async-grpo: warning: {message}", file=sys.stderr)


class MetricsSink(ABC):
    """Receives what `MetricsWriter` writes: rows of scalars, and the config.

    `log` gets one row: the step and its finite values (NaN/inf already left out) under
    the JSONL's names; rows come in the order written, and a row may carry an earlier step
    than the one before it (an evaluation of an older policy version). A sink may raise:
    the writer then warns, counts it and stops calling that sink.
    """

    name: str  # "wandb": in warnings and in the line saying which sinks are on
    where: str  # where its data goes: a folder, a URI, a URL

    @abstractmethod
    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record `scalars` at `step`."""

    @abstractmethod
    def log_params(self, params: dict[str, Any]) -> None:
        """Record the run's config: the JSON of `training_params.json` (nested dicts)."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release; called once, at the end of the run."""
