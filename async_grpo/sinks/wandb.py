"""Weights & Biases: a run under `output_dir/wandb`, offline unless asked otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from async_grpo.sinks.base import MetricsSink

STEP_KEY = "step"  # the JSONL's own step column, W&B's x axis for every metric


class WandbSink(MetricsSink):
    """One `run.log` per row: `{"step": step, **scalars}`, names exactly as in the JSONL.

    Why not `run.log(scalars, step=step)`: W&B's own step must only grow, and an
    evaluation row can carry an earlier step than the training row before it, which W&B
    would drop with a warning. So every metric is defined against the `step` key
    (`define_metric("*", step_metric="step")`), the x axis the charts use, and W&B's
    internal `_step` just counts rows.

    Offline mode needs no network, no login and no API key; `wandb sync DIR` uploads it
    later. A resumed run (same output_dir) starts a new W&B run. Needs the `wandb`
    package; raises ImportError without.
    """

    name = "wandb"

    def __init__(
        self, output_dir: Path, project: str, run_name: str, mode: Literal["offline", "online"]
    ) -> None:
        import wandb

        settings = wandb.Settings(
            silent=True,  # `open_sinks` prints one line saying where the run is
            disable_git=True,  # no git probing of the working directory
            # The trainer's output already goes to output_dir's logs; capturing rank 0's
            # stdout/stderr would wrap the streams and copy the progress bar into W&B.
            console="off",
        )
        self._run = wandb.init(
            project=project, name=run_name, dir=output_dir, mode=mode, settings=settings
        )
        self._run.define_metric(STEP_KEY)
        self._run.define_metric("*", step_metric=STEP_KEY)
        self.where = (
            f"{Path(self._run.settings.sync_dir)} (offline; upload with `wandb sync`)"
            if mode == "offline"
            else str(self._run.url)
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log({STEP_KEY: step, **scalars})

    def log_params(self, params: dict[str, Any]) -> None:
        """The config as W&B's run config (nested dicts kept); a later call updates it."""
        self._run.config.update(params, allow_val_change=True)

    def close(self) -> None:
        self._run.finish()
