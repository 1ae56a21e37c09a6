"""The `async-grpo plot` subcommand: metrics JSONL files in, a PNG/SVG (or a key list) out.

    async-grpo plot METRICS.jsonl... -v KEY [-v KEY ...] [-x KEY] [--smooth N] -o out.png
    async-grpo plot --list METRICS.jsonl...

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
