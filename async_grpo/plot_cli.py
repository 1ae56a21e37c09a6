"""The `async-grpo plot` subcommand: metrics JSONL files in, a PNG/SVG (or a key list) out.

    async-grpo plot METRICS.jsonl... -v KEY [-v KEY ...] [-x KEY] [--smooth N] -o out.png
    async-grpo plot --list METRICS.jsonl...
    async-grpo timeline RUN_DIR [--steps A:B] -o timeline.png

matplotlib is imported only when the command runs, so registering the parser is cheap.
"""

from __future__ import annotations

import argparse
from typing import Any

from async_grpo.errors import UserError


def run_plot(args: argparse.Namespace) -> int:
    """Print the keys (`--list`) or write the figure and print its path."""
    from async_grpo.plot import list_keys, plot

    if args.list:
        keys = list_keys(args.files)
        if not keys:
            raise UserError(f"no numeric metrics in {', '.join(args.files)}")
        print("\n".join(keys))
        return 0
    if not args.y_keys:
        raise UserError("name at least one metric with -v KEY (see: async-grpo plot --list FILE)")
    if args.out is None:
        raise UserError("name the output file with -o out.png or -o out.svg")
    print(f"wrote {plot(args.files, args.y_keys, args.x_key, args.smooth, out=args.out)}")
    return 0


def add_plot_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `plot` on an `add_subparsers()` object; its `func` is `run_plot`."""
    p = subparsers.add_parser(
        "plot",
        help="plot training_metrics.jsonl files (several runs overlaid)",
        description="Plot metrics from one or more training_metrics.jsonl files, "
        "one panel per -v KEY, runs overlaid.",
    )
    p.add_argument("files", nargs="+", metavar="METRICS.jsonl")
    p.add_argument(
        "-v", "--value", dest="y_keys", action="append", metavar="KEY", help="metric (repeatable)"
    )
    p.add_argument("-x", dest="x_key", default="step", metavar="KEY", help="x axis (default: step)")
    p.add_argument(
        "--smooth", type=int, default=1, metavar="N", help="moving average over N points"
    )
    p.add_argument("-o", "--out", help="output file, .png or .svg")
    p.add_argument("--list", action="store_true", help="print the metric keys, one per line")
    p.set_defaults(func=run_plot)
    return p


def run_timeline(args: argparse.Namespace) -> int:
    """Draw the run's timeline.jsonl and print its path and each lane's busy share."""
    from async_grpo.timeline import busy_shares, draw, read_timeline, select_steps

    spans = read_timeline(args.run)
    if args.steps is not None:
        first, sep, last = args.steps.partition(":")
        try:
            a, b = int(first), int(last or first)
        except ValueError:
            raise UserError(
                f"--steps {args.steps}: expected A:B (step numbers, both included)"
            ) from None
        spans = select_steps(spans, a, b)
    title = f"{args.run}" + (f", steps {args.steps}" if args.steps else "")
    print(f"wrote {draw(spans, args.out, title)}")
    for lane, share in busy_shares(spans).items():
        print(f"{lane}: busy {share:.1%}")
    return 0


def add_timeline_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `timeline` on an `add_subparsers()` object; its `func` is `run_timeline`."""
    p = subparsers.add_parser(
        "timeline",
        help="draw when the trainer and each worker worked (a run's timeline.jsonl)",
        description="One lane per part of the run: the trainer (waiting, training, pushing,"
        " saving), each generation worker (generating, by version served), the verifier.",
    )
    p.add_argument("run", metavar="RUN_DIR", help="a run's output_dir, or its timeline.jsonl")
    p.add_argument("--steps", metavar="A:B", help="only the spans of steps A to B")
    p.add_argument("-o", "--out", required=True, help="output file, .png or .svg")
    p.set_defaults(func=run_timeline)
    return p
