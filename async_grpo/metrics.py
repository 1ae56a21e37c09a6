"""Training metrics on disk: `training_params.json` once, `training_metrics.jsonl` per step.

In: the trainer's per-step scalars (python, numpy or torch scalars). Out: one JSON object
per line, `{"step": 3, "reward/mean": 0.41, ...}`, flushed at once so a killed run keeps
every finished step. NaN and infinities are not valid JSON: they are written as `null`
and counted in `MetricsWriter.non_finite` (and warned about once), never raised, so one
bad batch cannot stop a run. `read_metrics` reads the file back for `async-grpo plot`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from async_grpo.errors import UserError

PARAMS_FILE = "training_params.json"
METRICS_FILE = "training_metrics.jsonl"


def _warn(message: str) -> None:
    print(f"async-grpo: warning: {message}", file=sys.stderr)


def to_scalar(key: str, value: Any) -> int | float | None:
    """A python int or float for `value`; numpy/torch scalars and 1-element tensors too.

    Bools become 0/1; NaN and +-inf become None (written as JSON null). Anything else
    (a string, a many-element tensor) raises TypeError naming the key.
    """
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        try:
            value = value.item()  # numpy scalar, 0-d array, torch tensor of one element
        except (ValueError, RuntimeError) as e:
            raise TypeError(f"metric '{key}': expected a scalar, got {type(value)}") from e
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    raise TypeError(f"metric '{key}': expected an int or float, got {type(value).__name__}")


class MetricsWriter:
    """Appends one JSON line per `log` call to `output_dir/training_metrics.jsonl`.

    The file is opened in append mode, so a resumed run continues the same file; with
    `after_step` the rows of later steps (written by a run that went on past the
    checkpoint it is resumed from) are dropped first, so every step appears once. With
    `tensorboard=True` the same scalars also go to a TensorBoard event file in
    `output_dir/tensorboard` when `torch.utils.tensorboard` is importable (otherwise a
    warning and nothing more).
    """

    def __init__(
        self, output_dir: str | Path, tensorboard: bool = False, after_step: int | None = None
    ) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / METRICS_FILE
        self.non_finite = 0  # NaN/inf values written as null so far
        if after_step is not None and self.path.is_file():
            self._keep_until(after_step)
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = _open_tensorboard(self.output_dir / "tensorboard") if tensorboard else None

    def write_params(self, params: dict[str, Any]) -> Path:
        """Write `training_params.json` atomically (temp file + rename); return its path.

        Values JSON cannot hold (paths, enums) are written with `str()`.
        """
        path = self.output_dir / PARAMS_FILE
        text = json.dumps(params, indent=2, sort_keys=True, default=str, allow_nan=False)
        fd, tmp = tempfile.mkstemp(prefix=f".{PARAMS_FILE}-", dir=self.output_dir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text + "\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def _keep_until(self, step: int) -> None:
        """Rewrite the file (atomically) without the rows of steps after `step`."""
        kept = []
        for text in self.path.read_text(encoding="utf-8").splitlines(keepends=True):
            try:
                row = json.loads(text)
            except json.JSONDecodeError:
                continue  # a line cut by a kill mid-write
            if isinstance(row, dict) and int(row.get("step", 0)) <= step:
                kept.append(text if text.endswith("\n") else text + "\n")
        fd, tmp = tempfile.mkstemp(prefix=f".{METRICS_FILE}-", dir=self.output_dir)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append `{"step": step, **metrics}` as one line and flush it."""
        if "step" in metrics:
            raise ValueError("metrics must not contain 'step'; pass it as the step argument")
        row: dict[str, int | float | None] = {"step": int(step)}
        for key, value in metrics.items():
            scalar = to_scalar(key, value)
            if scalar is None:
                if self.non_finite == 0:
                    _warn(f"step {step}: metric '{key}' is not finite; written as null")
                self.non_finite += 1
            row[key] = scalar
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, scalar in row.items():
                if key != "step" and scalar is not None:
                    self._tb.add_scalar(key, scalar, global_step=row["step"])

    def close(self) -> None:
        """Close the JSONL file and the TensorBoard writer; safe to call twice."""
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_tensorboard(log_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        _warn("tensorboard=True but the tensorboard package is not installed; skipping it")
        return None
    return SummaryWriter(log_dir=str(log_dir))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a metrics JSONL file, in order; blank lines are skipped.

    A bad line raises `UserError("FILE:LINE: not valid JSON ...")`, except a last line
    with no newline at the end: that is a run killed mid-write, skipped with a warning.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: metrics file not found")
    with path.open(encoding="utf-8") as f:
        lines = f.readlines()
    rows = []
    for lineno, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            if lineno == len(lines) and not text.endswith("\n"):
                _warn(f"{path}:{lineno}: skipping a truncated last line (run killed mid-write?)")
                break
            raise UserError(
                f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})"
            ) from None
        if not isinstance(row, dict):
            raise UserError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows
