"""Which metrics sinks a run opens: the one place that reads `TrackersConfig`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from async_grpo.sinks.base import INSTALL_HINT, MetricsSink, warn
from async_grpo.sinks.mlflow import MlflowSink
from async_grpo.sinks.tensorboard import TensorBoardSink
from async_grpo.sinks.wandb import WandbSink

if TYPE_CHECKING:
    from async_grpo.config import TrackersConfig


def open_sinks(trackers: TrackersConfig, output_dir: Path) -> list[MetricsSink]:
    """Open every tracker `trackers` turns on, in the order tensorboard, wandb, mlflow,
    and print one line saying which and where (nothing when none is on).

    A tracker whose package cannot be imported is left out with one warning line naming
    the package and the extra that installs it; the run goes on with the others and the
    JSONL. Any other error while opening one (a bad MLflow URI, a failed W&B login) is
    raised: the config asked for it and the run has not started yet.
    """
    output_dir = Path(output_dir)
    run_name = trackers.run_name or output_dir.resolve().name
    wanted: list[tuple[str, str, Callable[[], MetricsSink]]] = []  # (key, package, open)
    if trackers.tensorboard:
        wanted.append(
            ("tensorboard", "tensorboard", lambda: TensorBoardSink(output_dir / "tensorboard"))
        )
    if trackers.wandb:
        mode = trackers.wandb_mode
        wanted.append(
            ("wandb", "wandb", lambda: WandbSink(output_dir, trackers.project, run_name, mode))
        )
    if trackers.mlflow:
        uri = trackers.mlflow_uri
        wanted.append(
            (
                "mlflow",
                "mlflow-skinny",
                lambda: MlflowSink(output_dir, trackers.project, run_name, uri),
            )
        )
    sinks: list[MetricsSink] = []
    for key, package, open_sink in wanted:
        try:
            sinks.append(open_sink())
        except ImportError as e:
            warn(
                f"trackers.{key} is on but the {package} package is not importable ({e});"
                f" going on without it. Install it with: {INSTALL_HINT}"
            )
        except BaseException:
            for sink in sinks:  # the ones already open: their runs end before the error
                sink.close()
            raise
    if sinks:
        print("trackers: " + "; ".join(f"{s.name} -> {s.where}" for s in sinks), flush=True)
    return sinks
