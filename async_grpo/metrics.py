"""Training metrics on disk: `training_params.json` once, `training_metrics.jsonl` per step.

In: the trainer's per-step scalars (python, numpy or torch scalars). Out: one JSON object
per line, `{"step": 3, "reward/mean": 0.41, ...}`, flushed at once so a killed run keeps
every finished step. NaN and infinities are not valid JSON: they are written as `null`
and counted in `MetricsWriter.non_finite` (and warned about once), never raised, so one
bad batch cannot stop a run. The same rows (finite values only) and the config also go to
the experiment trackers the config turns on (`async_grpo/sinks`: TensorBoard, W&B,
MLflow). `read_metrics` reads the file back for `async-grpo plot`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from async_grpo.errors import UserError
from async_grpo.sinks.base import MetricsSink
from async_grpo.sinks.base import warn as _warn
from async_grpo.sinks.select import open_sinks
from async_grpo.text import text_lines

if TYPE_CHECKING:
    from async_grpo.config import TrackersConfig

PARAMS_FILE = "training_params.json"
METRICS_FILE = "training_metrics.jsonl"


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
    checkpoint it is resumed from) are dropped first, so every step appears once.

    `trackers` opens the experiment trackers it turns on (`sinks.select.open_sinks`; their
    packages are imported only then). Each row goes to the JSONL first, then its finite
    values to every sink; the config goes to each sink's `log_params`. A sink that raises
    is warned about, counted in `sink_errors` and not called again: the JSONL and the other
    sinks go on, and so does training.
    """

    def __init__(
        self,
        output_dir: str | Path,
        trackers: TrackersConfig | None = None,
        after_step: int | None = None,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / METRICS_FILE
        self.non_finite = 0  # NaN/inf values written as null so far
        if after_step is not None and self.path.is_file():
            self._keep_until(after_step)
        self._file = self.path.open("a", encoding="utf-8")
        self.sink_errors = 0  # sinks turned off after they raised
        self.sinks: list[MetricsSink] = []
        if trackers is not None:
            try:
                self.sinks = open_sinks(trackers, self.output_dir)
            except BaseException:
                self._file.close()
                raise

    def write_params(self, params: dict[str, Any]) -> Path:
        """Write `training_params.json` atomically (temp file + rename); return its path.

        Values JSON cannot hold (paths, enums) are written with `str()`. The sinks get the
        file's JSON (`log_params`).
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
        written = json.loads(text)
        for sink in list(self.sinks):
            self._call(sink, "log_params", written)
        return path

    def _keep_until(self, step: int) -> None:
        """Rewrite the file (atomically) without the rows of steps after `step`."""
        kept = []
        for text in self.path.read_text(encoding="utf-8").splitlines(keepends=True):
            try:
                row = json.loads(text)
            except json.JSONDecodeError:
                continue  # a line cut by a kill mid-write
            # a fresh run (step 0) keeps nothing: its step-0 rows (evaluations) are new
            if isinstance(row, dict) and step > 0 and int(row.get("step", 0)) <= step:
                kept.append(text if text.endswith("\n") else text + "\n")
        fd, tmp = tempfile.mkstemp(prefix=f".{METRICS_FILE}-", dir=self.output_dir)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append `{"step": step, **metrics}` as one line and flush it; then the non-null
        values go to each sink."""
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
        scalars = {k: v for k, v in row.items() if k != "step" and v is not None}
        for sink in list(self.sinks):
            self._call(sink, "log", row["step"], scalars)

    def _call(self, sink: MetricsSink, method: str, *args: Any) -> None:
        """`sink.method(*args)`; if it raises: warn, count, close it and stop calling it."""
        try:
            getattr(sink, method)(*args)
        except Exception as e:
            self.sink_errors += 1
            self.sinks.remove(sink)
            _warn(
                f"metrics sink {sink.name}: {method} raised {e!r}; it is turned off for the"
                f" rest of the run ({self.path.name} keeps every row)"
            )
            if method != "close":
                # Best effort to release what it holds; its failure is already counted.
                with contextlib.suppress(Exception):
                    sink.close()

    def close(self) -> None:
        """Close the JSONL file and every sink; safe to call twice."""
        if not self._file.closed:
            self._file.close()
        for sink in list(self.sinks):
            self._call(sink, "close")
        self.sinks = []

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a metrics JSONL file, in order; blank lines are skipped.

    A bad line raises `UserError("FILE:LINE: not valid JSON ...")`, except a last line
    with no newline at the end: that is a run killed mid-write, skipped with a warning.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: metrics file not found")
    lines = list(text_lines(path))
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


def summary_line(output_dir: str | Path, wall_s: float, last: int = 4) -> str:
    """The line a finished run ends with, read back from its own files: steps, the mean
    training reward of the last `last` steps, the last held-out pass@1, the wall time, the
    newest checkpoint and the metrics file."""
    out = Path(output_dir)
    path = out / METRICS_FILE
    rows = read_metrics(path) if path.is_file() else []
    train = [r for r in rows if "loss" in r]
    parts = [f"{train[-1]['step'] if train else 0} steps in {_duration(wall_s)}"]
    rewards = [r["reward/mean"] for r in train[-last:] if "reward/mean" in r]
    if rewards:
        parts.append(
            f"training reward {sum(rewards) / len(rewards):.3f} (last {len(rewards)} steps)"
        )
    held_out = [r for r in rows if "eval/pass_at_1" in r]
    if held_out:
        e = held_out[-1]
        parts.append(f"held-out pass@1 {e['eval/pass_at_1']:.3f} at version {e['step']}")
    latest = out / "checkpoints" / "latest"
    if latest.is_file():
        parts.append(f"checkpoint {latest.parent / latest.read_text().strip()}")
    parts.append(f"metrics {path}")
    return "done: " + "; ".join(parts)


def _duration(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s} s" if m else f"{s} s"
