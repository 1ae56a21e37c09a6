"""The `async-grpo` console script: parse arguments, import the heavy code lazily, run.

A `UserError` anywhere below becomes one line on stderr and exit code 2 (in a rank of
`async-grpo run`, the run's cause line, which `run` prints: async_grpo/cause.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

from async_grpo.cause import CAUSE_FILE_ENV
from async_grpo.cause import record as record_cause
from async_grpo.cli_cluster import add_cluster_parsers
from async_grpo.errors import EXIT_FILE_ENV, UserError
from async_grpo.plot_cli import add_plot_parser, add_timeline_parser


def _prepare_model(args: argparse.Namespace) -> int:
    from async_grpo.models import prepare_model

    print(prepare_model(args.name, Path(args.out) if args.out else None, force=args.force))
    return 0


def _data(args: argparse.Namespace) -> int:
    from async_grpo.data import load_prompts, write_jsonl
    from async_grpo.data.generate import (
        arithmetic_rows,
        calculator_rows,
        countdown_rows,
        guess_rows,
        math_rows,
    )

    if args.data_cmd == "countdown":
        rows = countdown_rows(
            args.n, args.seed, args.min_numbers, args.max_numbers, args.max_number, args.max_target
        )
    elif args.data_cmd == "math":
        rows = math_rows(args.n, args.seed)
    elif args.data_cmd == "arithmetic":
        if args.max_operand < 1:
            raise UserError(f"--max-operand: must be >= 1, got {args.max_operand}")
        rows = arithmetic_rows(args.n, args.seed, args.max_operand, args.plain)
    elif args.data_cmd == "calculator":
        if min(args.digits) < 1:
            raise UserError(f"--digits: each must be >= 1, got {args.digits}")
        rows = calculator_rows(args.n, args.seed, tuple(args.digits))
    elif args.data_cmd == "guess":
        if args.high < 2:
            raise UserError(f"--high: must be >= 2, got {args.high}")
        rows = guess_rows(args.n, args.seed, args.high)
    elif args.data_cmd == "check":
        return _check_data(args)
    else:  # tokenize
        from async_grpo.data.tokenize import tokenize_prompts
        from async_grpo.models import resolve_model

        model_dir = resolve_model(args.model)
        prompts = tokenize_prompts(load_prompts(args.input), model_dir, args.prompt_format)
        rows = [p.to_json() for p in prompts]
    if getattr(args, "exclude", None):
        rows = held_out_rows(rows, args.exclude)
    if getattr(args, "messages", False):  # the prompt as a chat: one user message
        rows = [{"messages": [{"role": "user", "content": r.pop("input")}], **r} for r in rows]
    if Path(args.out).suffix == ".parquet":
        from async_grpo.data.forms import write_parquet

        n = write_parquet(args.out, rows)
    else:
        n = write_jsonl(args.out, rows)
    print(f"wrote {n} rows to {args.out}")
    return 0


def held_out_rows(rows: list[dict], exclude: list[str]) -> list[dict]:
    """`rows` without any whose prompt is in one of the `exclude` files, and without
    repeats: a held-out evaluation set (`eval.data`)."""
    from async_grpo.data import load_prompts

    seen = {p.input for path in exclude for p in load_prompts(path)}
    kept = []
    for row in rows:
        if row["input"] not in seen:
            seen.add(row["input"])
            kept.append(row)
    if not kept:
        raise UserError(f"--exclude: every generated prompt is in {', '.join(exclude)}")
    return kept


def _check_data(args: argparse.Namespace) -> int:
    """`data check`: a JSONL file alone against the strict schema; with --config (or any
    other form) every row as a run reads it (rows shaped by dataset.map prepared into the
    cache a run then opens)."""
    if args.config is None and not args.set and str(args.input or "").endswith(".jsonl"):
        from async_grpo.data import load_prompts

        prompts = load_prompts(args.input)
        print(f"{args.input}: {len(prompts)} prompts, all valid")
        return 0
    if args.input is None and args.config is None:
        raise UserError("data check: give a FILE (or folder) to check, or --config CONFIG")
    from async_grpo.data.tokenize import prepare_prompts
    from async_grpo.models import resolve_model
    from async_grpo.preflight.settings import load_config

    cfg = load_config(args.config, [*args.set, *([f"data={args.input}"] if args.input else [])])
    model_dir = resolve_model(cfg.model)
    from async_grpo.preflight import environment_data

    environment_data(cfg)  # `data: environment`: the verifiers environment's, as a file
    checked = [(cfg.data, cfg.dataset)]
    if cfg.eval.data and args.input is None:  # the config's held-out set too
        checked.append((cfg.eval.data, cfg.eval_dataset))
    for data, dataset in checked:
        table = prepare_prompts(
            data, model_dir, cfg.generation.max_model_len, cfg.prompt_format, dataset
        )
        kept = f"; prepared for {cfg.model}: {table.path}" if table.path != str(data) else ""
        print(f"{data}: {len(table)} prompts, all valid{kept}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from async_grpo.preflight.settings import load_config
    from async_grpo.trainer.setup import train

    cfg = load_config(args.config, args.overrides)
    under_run = bool(os.environ.get(EXIT_FILE_ENV))
    if under_run:  # `run` checked all of it before it started Ray and torchrun
        sys.unraisablehook = _exit_on_lost_stop
    else:  # by hand under torchrun: every rank refuses what `run` would, before Ray
        from async_grpo.preflight import checked_before_ray

        checked_before_ray(
            cfg, "train", resume=args.resume, address=args.address or cfg.ray_address
        )
    try:
        train(cfg, args.address or cfg.ray_address, args.resume, args.verbose)
    except Exception as e:
        if isinstance(e, UserError) or not under_run:
            raise  # a user error is one line already; run by hand, the traceback shows
        _trainer_failed(e, cfg.output_dir, args.verbose)
        return 1
    finally:
        if under_run:  # past train(), the stop that torchrun sends the ranks just ends this
            # one; Ray's handler would raise SystemExit into the interpreter's shutdown
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return 0


def _exit_on_lost_stop(unraisable: Any) -> None:
    """Ray's SIGTERM handler raises SystemExit wherever the rank is; inside a finalizer (an
    actor handle's `__del__`) Python would print it as a traceback on the run's console and
    drop it, and the rank would run on until torchrun kills it. Under `run` the rank ends
    there instead, with the signal's code (run's own sweep removes the run's files)."""
    if isinstance(unraisable.exc_value, SystemExit):
        code = unraisable.exc_value.code
        if code in (signal.SIGTERM, signal.SIGINT):  # die by the signal, as torchrun expects
            signal.signal(code, signal.SIG_DFL)
            os.kill(os.getpid(), code)
        os._exit(code if isinstance(code, int) else 1)
    sys.__unraisablehook__(unraisable)


def _trainer_failed(e: Exception, output_dir: str, verbose: bool) -> None:
    """Under `async-grpo run`: the traceback goes to OUTPUT_DIR/logs/trainer-rankR.log,
    and its cause, as one line, to this rank's cause file; the launcher picks the run's
    cause among the ranks' (launcher.py) and `run` prints it. (--verbose: the traceback
    goes to the console too.)"""
    import traceback

    from async_grpo.launcher import write_rank_cause
    from async_grpo.logs import log_dir

    text = "".join(traceback.format_exception(e))
    rank = os.environ.get("RANK", "0")
    path = log_dir(output_dir) / f"trainer-rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(text)
    write_rank_cause(rank, f"{_cause(e)} (traceback: {path})")
    if verbose:
        print(text, file=sys.stderr, flush=True)


def _cause(e: BaseException) -> str:
    """`Type: first line` of the innermost error; through Ray, the actor's own error."""
    while getattr(e, "cause", None) is not None:  # RayTaskError and RayActorError
        e = e.cause
    first = next((x for x in str(e).splitlines() if x.strip()), "")
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _run(args: argparse.Namespace) -> int:
    from async_grpo.preflight import checked_before_ray
    from async_grpo.preflight.settings import load_config
    from async_grpo.run import run_local, stop_on_signals

    cfg = load_config(args.config, args.overrides)
    stop_on_signals()
    address = args.address or cfg.ray_address
    model_dir = checked_before_ray(cfg, "run", resume=args.resume, address=address)
    return run_local(
        cfg, model_dir, args.config, args.overrides, address, args.resume, args.verbose
    )


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config (configs/quickstart.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-6")
    p.add_argument("--address", default=None, help="Ray cluster address")
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        help="resume from the latest checkpoint of output_dir, or from a step dir",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="stream every worker's output to the console (default: OUTPUT_DIR/logs/)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="async-grpo", description="Asynchronous GRPO training on Ray (vLLM + FSDP2)."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "prepare-model", help="convert a known model's GGUF (from PyPI) to a HF folder, once"
    )
    p.add_argument(
        "name",
        nargs="?",
        default="smollm2-135m",
        help="smollm2-135m (SmolLM2-135M-Instruct, the default) or gemma3-270m (Gemma 3 270M base)",
    )
    p.add_argument("--out", help="target folder (default: the cache, see ASYNC_GRPO_CACHE)")
    p.add_argument("--force", action="store_true", help="convert again even if present")
    p.set_defaults(func=_prepare_model)

    p = sub.add_parser("data", help="generate (JSONL or parquet), check or tokenize prompt files")
    dsub = p.add_subparsers(dest="data_cmd", required=True, metavar="DATA_COMMAND")
    d = dsub.add_parser("countdown", help="seeded Countdown problems (3 to 4 numbers)")
    d.add_argument("-n", type=int, default=1000)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--min-numbers", type=int, default=3)
    d.add_argument("--max-numbers", type=int, default=4)
    d.add_argument("--max-number", type=int, default=99)
    d.add_argument("--max-target", type=int, default=100)
    d.add_argument("-o", "--out", required=True)
    d = dsub.add_parser("math", help="seeded arithmetic questions with LaTeX answers")
    d.add_argument("-n", type=int, default=200)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("-o", "--out", required=True)
    d = dsub.add_parser(
        "arithmetic", help="seeded one-step integer questions (a + b, a - b, a * b)"
    )
    d.add_argument("-n", type=int, default=1000)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--max-operand", type=int, default=9)
    d.add_argument(
        "--plain",
        action="store_true",
        help="few-shot plain-text prompts for base models (reward: first_number)",
    )
    d.add_argument("-o", "--out", required=True)
    d = dsub.add_parser("calculator", help="seeded products for the calculator environment")
    d.add_argument("-n", type=int, default=1000)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--digits", type=int, nargs=2, default=[3, 2], metavar=("A", "B"))
    d.add_argument("-o", "--out", required=True)
    d = dsub.add_parser("guess", help="seeded secrets for the guess_number environment")
    d.add_argument("-n", type=int, default=1000)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--high", type=int, default=10)
    d.add_argument("-o", "--out", required=True)
    for gen in ("countdown", "math", "arithmetic", "calculator", "guess"):
        dsub.choices[gen].add_argument(
            "--exclude",
            nargs="+",
            metavar="FILE",
            help="drop prompts found in these files, and repeats (a held-out set)",
        )
        dsub.choices[gen].add_argument(
            "--messages",
            action="store_true",
            help="the prompt as a `messages` column (a list with one user message), read"
            " with dataset.prompt_key=messages; -o x.parquet writes parquet (docs/data.md)",
        )
    d = dsub.add_parser(
        "check",
        help="check every row as a run reads it (any form; docs/data.md), or a JSONL file"
        " against the strict schema",
    )
    d.add_argument("input", nargs="?", help="a file or folder (default: the config's data)")
    d.add_argument(
        "--config", help="a run config: its model, dataset section, prompt_format and context"
    )
    d.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override"
    )
    d = dsub.add_parser("tokenize", help="add input_token_ids (the model's chat template)")
    d.add_argument("input")
    d.add_argument("--model", default="smollm2-135m", help="model folder or prepared name")
    d.add_argument(
        "--prompt-format",
        choices=["chat", "plain"],
        default="chat",
        help="chat: a user turn in the chat template; plain: the text as it is",
    )
    d.add_argument("-o", "--out", required=True)
    p.set_defaults(func=_data)

    p = sub.add_parser("run", help="train on this machine: Ray, pools and torchrun, one command")
    _add_run_args(p)
    p.set_defaults(func=_run)

    p = sub.add_parser("train", help="the trainer; run it under torchrun against running pools")
    _add_run_args(p)
    p.set_defaults(func=_train)

    p = sub.add_parser("env-server", help="serve an environment over HTTP (environment.url)")
    p.add_argument("name", help="environment name or module:Class")
    p.add_argument("--host", default="127.0.0.1", help="any but loopback needs a token")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument(
        "--token-file",
        help="file holding the shared token clients must send (default: $ASYNC_GRPO_ENV_TOKEN)",
    )
    p.add_argument("--max-sessions", type=int, default=1024, help="open sessions; more get 503")
    p.add_argument(
        "--session-ttl-s", type=float, default=3600.0, help="close sessions idle this long"
    )
    p.add_argument(
        "--timeout-s", type=float, default=30.0, help="seconds a client may take to send a request"
    )
    p.add_argument("--threads", type=int, default=16, help="threads for plain (not async) methods")
    p.set_defaults(func=_env_server)

    add_cluster_parsers(sub)
    add_plot_parser(sub)
    add_timeline_parser(sub)
    from async_grpo.eval_cli import add_eval_parser

    add_eval_parser(sub)
    from async_grpo.export import add_export_parser

    add_export_parser(sub)
    return parser


def _env_server(args: argparse.Namespace) -> int:
    from async_grpo.environments.http import read_token, serve

    token = read_token(args.token_file)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is the way to stop it
        serve(
            args.name,
            args.host,
            args.port,
            token=token,
            max_sessions=args.max_sessions,
            session_ttl_s=args.session_ttl_s,
            timeout_s=args.timeout_s,
            threads=args.threads,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        line = f"async-grpo: error: {e}"
        if os.environ.get(CAUSE_FILE_ENV):  # a rank of `async-grpo run`: the run prints the
            record_cause(line)  # first cause recorded, once it has stopped (cause.py)
        else:
            print(line, file=sys.stderr)
        exit_file = os.environ.get(EXIT_FILE_ENV)  # set by `async-grpo run` for its ranks
        if exit_file:  # torchrun itself exits 1 whatever its ranks' codes were
            Path(exit_file).write_text(f"{e.exit_code}\n")
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
