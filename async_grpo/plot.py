"""Plot `training_metrics.jsonl` files: several runs overlaid, one panel per metric.

In: metrics JSONL paths (see `async_grpo.metrics`), metric keys. Out: a PNG or SVG file.
Each run keeps one colour across panels; its label is the run folder's name for a file
called `training_metrics.jsonl`, else the file's stem. With `smooth > 1` the raw curve is
drawn faint and a trailing moving average over `smooth` points bold on top of it. Rows
where the x or y value is missing or null (a NaN at write time) are left out of that curve.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from async_grpo.errors import UserError
from async_grpo.metrics import METRICS_FILE, read_metrics

FORMATS = (".png", ".svg")


@dataclass
class Run:
    """One metrics file: `label` names it in legends, `rows` are its JSON objects in order."""

    label: str
    path: Path
    rows: list[dict[str, Any]]

    def series(self, x_key: str, y_key: str) -> tuple[list[float], list[float]]:
        """The (x, y) pairs of the rows where both values are numbers, in file order."""
        xs, ys = [], []
        for row in self.rows:
            x, y = row.get(x_key), row.get(y_key)
            if _is_number(x) and _is_number(y):
                xs.append(x)
                ys.append(y)
        return xs, ys


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _label(path: Path) -> str:
    return path.parent.name if path.name == METRICS_FILE and path.parent.name else path.stem


def load_runs(paths: Sequence[str | Path]) -> list[Run]:
    """Read every file; labels that collide get their parent folder prefixed."""
    if not paths:
        raise UserError("no metrics files given")
    runs = [Run(_label(Path(p)), Path(p), read_metrics(p)) for p in paths]
    labels = [r.label for r in runs]
    for run in runs:
        if labels.count(run.label) > 1:
            run.label = str(run.path.parent / run.path.stem)
    return runs


def _numeric_keys(runs: Sequence[Run]) -> list[str]:
    return sorted({k for run in runs for row in run.rows for k, v in row.items() if _is_number(v)})


def list_keys(paths: Sequence[str | Path]) -> list[str]:
    """The sorted union of keys that hold a number in at least one row of any file."""
    return _numeric_keys(load_runs(paths))


def moving_average(values: Sequence[float], n: int) -> list[float]:
    """Trailing mean over the last `n` points; the first `n - 1` points average what exists.

    Same length as `values`, so it shares their x positions: [0, 0, 3, 3] with n=2 is
    [0, 0, 1.5, 3].
    """
    if n < 1:
        raise UserError(f"smoothing window must be at least 1, got {n}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= n:
            total -= values[i - n]
        out.append(total / min(i + 1, n))
    return out


def build_figure(
    runs: Sequence[Run], y_keys: Sequence[str], x_key: str = "step", smooth: int = 1
) -> Figure:
    """One panel per y key (shared x axis), every run that has the key overlaid on it.

    A key no run has raises UserError listing the keys there are; a run lacking a key
    that others have is left out of that panel with a warning on stderr.
    """
    if not y_keys:
        raise UserError("no metric to plot; name one with -v KEY (see --list)")
    if smooth < 1:
        raise UserError(f"--smooth must be at least 1, got {smooth}")
    y_keys = list(dict.fromkeys(y_keys))  # drop repeats, keep order
    available = _numeric_keys(runs)
    for key, role in [(x_key, " (x axis)")] + [(k, "") for k in y_keys]:
        if key not in available:
            raise UserError(
                f"metric '{key}'{role} is in none of the files; "
                f"available: {', '.join(available) or '(none)'}"
            )

    fig = Figure(figsize=(9, 0.8 + 2.6 * len(y_keys)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(y_keys), 1, sharex=True, squeeze=False)[:, 0]
    for ax, key in zip(axes, y_keys, strict=True):
        for i, run in enumerate(runs):
            xs, ys = run.series(x_key, key)
            if not xs:
                print(f"async-grpo: warning: {run.path}: no '{key}'; left out", file=sys.stderr)
                continue
            color = f"C{i % 10}"
            if smooth > 1:
                ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1)
                ax.plot(xs, moving_average(ys, smooth), color=color, linewidth=2, label=run.label)
            else:
                ax.plot(xs, ys, color=color, linewidth=1.5, label=run.label)
        ax.set_ylabel(key)
        ax.set_title(key, fontsize=10, loc="left")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8, loc="best")
    axes[-1].set_xlabel(x_key)
    title = f"{', '.join(y_keys)} vs {x_key}"
    if smooth > 1:
        title += f" (moving average over {smooth} points)"
    fig.suptitle(title)
    return fig


def plot(
    paths: Sequence[str | Path],
    y_keys: Sequence[str],
    x_key: str = "step",
    smooth: int = 1,
    *,
    out: str | Path,
) -> Path:
    """Draw the figure and save it; the format comes from `out`'s suffix (.png or .svg)."""
    out = Path(out)
    if out.suffix.lower() not in FORMATS:
        raise UserError(f"{out}: output must end in .png or .svg, got '{out.suffix}'")
    fig = build_figure(load_runs(paths), y_keys, x_key, smooth)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out
