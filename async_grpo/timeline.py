"""When each part of a run worked: `timeline.jsonl` and the `async-grpo timeline` figure.

A span is one stretch of work, in wall-clock seconds (`time.time()`, comparable across
the processes of a node): `{"step": 3, "lane": "trainer", "what": "train", "start": ...,
"end": ...}`. Lanes and what they show:

- `trainer` (rank 0): `wait` for samples or for generation before a push, `train`
  (forward/backward of a minibatch, the optimizer step), `push`, `save`, `hooks`.
- one lane per generation worker: `generate` while it has requests and is not paused for
  a weight update, with the `version` it served.
- `verifier`: `score`, one span per group, from the batcher's side.

`step` is the step whose row the span came with: the trainer's own step, and for the
pools the step being batched when the batcher read their spans. Rank 0 appends each
step's spans after its metrics row; a resumed run first drops the rows after the step it
resumes from, as the metrics file does.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from async_grpo.errors import UserError
from async_grpo.text import text_lines

TIMELINE_FILE = "timeline.jsonl"
MIN_SPAN_S = 1e-3  # shorter spans (a wait that found its minibatch ready) are not kept
TRAINER_COLOURS = {
    "wait": "#d0d0d0",
    "train": "#1f77b4",
    "push": "#d62728",
    "save": "#8c564b",
    "hooks": "#ff7f0e",
}
SCORE_COLOUR = "#444444"


class SpanLog:
    """Spans of one process, kept until taken."""

    def __init__(self, lane: str) -> None:
        self.lane = lane
        self.spans: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def span(self, what: str, **fields: Any) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.add(what, start, time.time(), **fields)

    def add(self, what: str, start: float, end: float, **fields: Any) -> None:
        if end - start >= MIN_SPAN_S:
            self.spans.append(
                {"lane": self.lane, "what": what, "start": start, "end": end} | fields
            )

    def take(self) -> list[dict[str, Any]]:
        out, self.spans = self.spans, []
        return out


class TimelineWriter:
    """Rank 0's `output_dir/timeline.jsonl`, appended a step at a time."""

    def __init__(self, output_dir: str | Path, start_step: int) -> None:
        self.path = Path(output_dir) / TIMELINE_FILE
        if self.path.is_file():  # each step once, as in the metrics
            kept = [
                line
                for line in self.path.read_text(encoding="utf-8").splitlines(keepends=True)
                if line.endswith("\n") and json.loads(line).get("step", 0) <= start_step
            ]
            self.path.write_text("".join(kept), encoding="utf-8")

    def write(self, step: int, spans: list[dict[str, Any]]) -> None:
        if not spans:
            return
        text = "".join(json.dumps(dict(s, step=step)) + "\n" for s in spans)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(text)


def read_timeline(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every span of the run in `run_dir` (a truncated last line is skipped)."""
    path = Path(run_dir)
    path = path / TIMELINE_FILE if path.is_dir() else path
    if not path.is_file():
        raise UserError(f"{path}: no such file (a run writes {TIMELINE_FILE} in its output_dir)")
    spans = []
    lines = list(text_lines(path))
    for lineno, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            row["start"], row["end"] = float(row["start"]), float(row["end"])
            str(row["lane"]), str(row["what"])
        except (ValueError, KeyError, TypeError):
            if lineno == len(lines):
                continue  # a run killed mid-write
            raise UserError(
                f"{path}:{lineno}: not a span (expected JSON with lane, what, start, end)"
            ) from None
        spans.append(row)
    if not spans:
        raise UserError(f"{path}: no spans")
    return spans


def select_steps(spans: list[dict[str, Any]], first: int, last: int) -> list[dict[str, Any]]:
    """The spans that came with steps first..last (both included)."""
    picked = [s for s in spans if first <= s.get("step", 0) <= last]
    if not picked:
        steps = sorted({s.get("step", 0) for s in spans})
        raise UserError(
            f"--steps {first}:{last}: no spans there (the timeline has steps"
            f" {steps[0]}..{steps[-1]})"
        )
    return picked


def busy_shares(spans: list[dict[str, Any]]) -> dict[str, float]:
    """Per lane, the share of the window (first start to last end of all spans) that its
    spans cover, overlaps counted once; for the trainer, its share not spent waiting."""
    t0 = min(s["start"] for s in spans)
    window = max(s["end"] for s in spans) - t0
    out = {}
    for lane in sorted({s["lane"] for s in spans}):
        mine = [(s["start"], s["end"]) for s in spans if s["lane"] == lane and s["what"] != "wait"]
        out[lane] = _covered(mine) / window if window > 0 else 0.0
    return out


def _covered(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def draw(spans: list[dict[str, Any]], out: str | Path, title: str = "") -> Path:
    """One horizontal lane per part (trainer on top, then the generation workers, then
    the verifier), seconds since the first span on x. The trainer's spans are coloured by
    what they are; generation by the version served (a palette apart from the trainer's,
    cycling, labelled where wide enough); scoring in one colour. Writes `out` (.png or
    .svg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    out = Path(out)
    if out.suffix not in (".png", ".svg"):
        raise UserError(f"-o {out}: the output must end in .png or .svg")
    lanes = sorted({s["lane"] for s in spans}, key=_lane_order)
    t0 = min(s["start"] for s in spans)
    t1 = max(s["end"] for s in spans)
    from matplotlib import colormaps

    versions = colormaps["Set2"].colors
    fig = Figure(figsize=(14, 1.8 + 0.55 * len(lanes)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    shares = busy_shares(spans)
    for y, lane in enumerate(lanes):
        mine = [s for s in spans if s["lane"] == lane]
        for s in mine:
            x, w = s["start"] - t0, s["end"] - s["start"]
            if lane == "trainer":
                colour = TRAINER_COLOURS.get(s["what"], "black")
            elif s["what"] == "generate":
                colour = versions[int(s.get("version", 0)) % len(versions)]
            else:
                colour = SCORE_COLOUR
            ax.broken_barh([(x, w)], (y - 0.4, 0.8), color=colour, alpha=0.85, linewidth=0)
            if s["what"] == "generate" and w > 0.04 * (t1 - t0):
                ax.text(x + w / 2, y, f"v{s.get('version', '?')}", ha="center", va="center")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"{lane} ({shares[lane]:.0%})" for lane in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_xlim(0, t1 - t0)
    handles = [Patch(color=c, label=f"trainer: {k}") for k, c in TRAINER_COLOURS.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5)
    ax.set_title(title or "busy share per lane in brackets (the trainer's: not waiting)")
    fig.tight_layout()
    fig.savefig(out)
    return out


def _lane_order(lane: str) -> tuple[int, str]:
    if lane == "trainer":
        return 0, lane
    if lane == "verifier":
        return 2, lane
    return 1, lane
