"""TensorBoard: scalars in an event file under `output_dir/tensorboard`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from async_grpo.sinks.base import MetricsSink


class TensorBoardSink(MetricsSink):
    """One `add_scalar` per value, tag = the JSONL name, global step = the row's step.

    Needs `torch.utils.tensorboard` (the `tensorboard` package); raises ImportError without.
    TensorBoard's reader keeps each tag's points in step order; rows of different tags
    (training, evaluation) may interleave steps freely.
    """

    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.where = str(log_dir)
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, global_step=step)

    def log_params(self, params: dict[str, Any]) -> None:
        """Nothing: TensorBoard has no flat place for a config; see training_params.json."""

    def close(self) -> None:
        self._writer.close()
