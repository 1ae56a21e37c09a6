"""The race: TRL's GRPOTrainer vs async-grpo to a training reward, one after the other.

    .venv/bin/python bench/vs_trl.py                    # one race: 40 steps or reward 0.8
    .venv/bin/python bench/vs_trl.py --runs 0,1,2       # three, seeds 0-2 (the spread)
    .venv/bin/python bench/vs_trl.py --table            # every race recorded so far

Same machine, model (SmolLM2-135M-Instruct), prompts (the first steps x questions rows of
sample-data/arithmetic.jsonl, in an order drawn from the run's seed by each side, chat
template applied by each side), group size, completion length, temperature, constant
learning rate on both sides (TRL's scheduler set to `constant`), no KL, and reward
(async-grpo's `last_number`, imported by the TRL job too). Each side trains until the mean
training reward of the last 3 steps reaches --target (0.8) or --steps (40) steps have run
(ours: `trainer.stop_at_reward`; TRL: a callback that stops `trainer.train()`). Both final
policies are then scored by the same command, `async-grpo eval` on
sample-data/arithmetic-heldout.jsonl (greedy, 126 questions no training prompt asks).

TRL runs in its own venv (bench/setup_trl.sh, same torch and transformers) with its CPU
defaults: HF `generate`, and bf16 autocast exactly where our `auto` computes in bf16 (CPUs
with native bf16 units); on an AVX2-only CPU both sides compute in fp32, since bf16 is
emulated there (--trl-bf16/--no-trl-bf16 force it). async-grpo runs `async-grpo run
configs/arithmetic.yaml` with the matching overrides.

Recorded per side and run (one JSON line each in --results, with the CPU's kind): time to
the target (TRL: from the start of `trainer.train()`; ours: `time/elapsed`, from the first
step waiting for samples), steps and samples run, samples per hour over the training, the
end-to-end wall time (process start to exit: loading, engine start), held-out greedy
accuracy of the final policy. The table gives the mean and each run's figure, and the
ratio of TRL's time to target over ours.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "sample-data" / "arithmetic.jsonl"
HELD_OUT = ROOT / "sample-data" / "arithmetic-heldout.jsonl"
CLI = [sys.executable, "-m", "async_grpo.cli"]


def run_trl(args: argparse.Namespace, seed: int, model_dir: str, data: Path, work: Path) -> dict:
    subprocess.run(["bash", str(ROOT / "bench" / "setup_trl.sh")], check=True)
    work.mkdir(parents=True, exist_ok=True)
    spec = {
        "model": model_dir,
        "data": str(data),
        "output_dir": str(work / "trl"),
        "steps": args.steps,
        "questions": args.questions,
        "group": args.group,
        "max_new_tokens": args.max_new_tokens,
        "temperature": 1.0,
        "lr": args.lr,
        "bf16": args.trl_bf16,
        "seed": seed,
        "target": args.target,
        "window": args.window,
    }
    (work / "trl_spec.json").write_text(json.dumps(spec))
    out = work / "trl_result.json"
    t0 = time.perf_counter()
    job = [str(ROOT / ".venv-trl" / "bin" / "python"), str(ROOT / "bench" / "trl_grpo_job.py")]
    job += ["--spec", str(work / "trl_spec.json"), "--out", str(out)]
    subprocess.run(job, check=True, timeout=args.timeout_s)
    r = json.loads(out.read_text())
    return {
        "time_to_target_s": r["time_to_target_s"],
        "steps": r["steps"],
        "samples": r["samples"],
        "train_s": r["seconds"],
        "end_to_end_s": time.perf_counter() - t0,
        "rewards": r["rewards"],
        "dtype": "bfloat16 autocast" if args.trl_bf16 else "float32",
        "final": r["final"],
    }


def run_ours(args: argparse.Namespace, seed: int, data: Path, work: Path) -> dict:
    out_dir = work / "async_grpo"
    overrides = [
        f"data={data}",
        f"output_dir={out_dir}",
        f"trainer.max_steps={args.steps}",
        f"trainer.stop_at_reward={args.target}",
        f"trainer.stop_window={args.window}",
        f"batcher.questions_per_step={args.questions}",
        f"batcher.samples_per_question={args.group}",
        f"generation.max_new_tokens={args.max_new_tokens}",
        f"trainer.lr={args.lr}",
        f"batcher.seed={seed}",
        "eval.data=null",  # both final policies are scored after training, the same way
        "sample_every=0",
    ]
    t0 = time.perf_counter()
    cmd = [*CLI, "run", str(ROOT / "configs" / "arithmetic.yaml"), *overrides]
    subprocess.run(cmd, check=True, timeout=args.timeout_s)
    end_to_end = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out_dir / "training_metrics.jsonl").open()]
    train = [r for r in rows if "time/step" in r]  # training steps, not evaluations
    rewards = [r["reward/mean"] for r in train]
    last = train[-1]
    reached = len(rewards) >= args.window and sum(rewards[-args.window :]) >= (
        args.target * args.window
    )
    params = json.loads((out_dir / "training_params.json").read_text())
    return {
        "time_to_target_s": last["time/elapsed"] if reached else None,
        "steps": len(train),
        "samples": int(last["samples_seen"]),
        "train_s": last["time/elapsed"],
        "end_to_end_s": end_to_end,
        "rewards": rewards,
        "dtype": params["resolved"]["trainer_compute_dtype"].split()[0],
        "final": str(sorted((out_dir / "checkpoints").glob("step_*"))[-1]),
    }


def held_out(model: str, work: Path) -> float:
    """Greedy pass@1 of `model` (a folder or checkpoint) on the held-out questions."""
    out = work / "eval"
    cmd = [*CLI, "eval", model, "--data", str(HELD_OUT), "--config"]
    cmd += [str(ROOT / "configs" / "arithmetic.yaml"), "-o", str(out)]
    subprocess.run(cmd, check=True, timeout=1800)
    return json.loads((out / "eval_summary.json").read_text())["metrics"]["eval/pass_at_1"]


def race(args: argparse.Namespace, seed: int) -> list[dict]:
    """Both sides with `seed`; a record per side."""
    from async_grpo.models import resolve_model
    from async_grpo.precision import cpu_kind

    model_dir = str(resolve_model("smollm2-135m"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True)
    records = []
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        work = Path(tmp)
        data = work / "prompts.jsonl"
        rows = DATA.read_text().splitlines()[: args.steps * args.questions]
        data.write_text("\n".join(rows) + "\n")
        sides = {"TRL": lambda: run_trl(args, seed, model_dir, data, work / "trl-side")}
        sides["async-grpo"] = lambda: run_ours(args, seed, data, work / "ours")
        for name, side in sides.items():
            if args.only and args.only != name:
                continue
            r = side()
            r["heldout"] = round(held_out(r.pop("final"), work / name), 4)
            r["samples_per_hour"] = round(r["samples"] / r["train_s"] * 3600)
            head = {"side": name, "seed": seed, "cpu": cpu_kind()}
            head["commit"] = commit.stdout.decode().strip()
            head |= {"target": args.target, "max_steps": args.steps}
            records.append(head | r)
            print(json.dumps({k: v for k, v in records[-1].items() if k != "rewards"}), flush=True)
    return records


def _cell(values: list) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "not reached"
    avg = f"{statistics.mean(known):.4g}"
    each = ", ".join("-" if v is None else f"{v:.4g}" for v in values)
    return f"{avg} ({each})" if len(values) > 1 else avg


def table(results: list[dict]) -> str:
    """Markdown: a row per side (mean over runs, each run in brackets), then the ratio."""
    cols = ["time_to_target_s", "steps", "heldout", "samples_per_hour", "end_to_end_s"]
    lines = ["| side | runs | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    by_side = {s: [r for r in results if r["side"] == s] for s in ("TRL", "async-grpo")}
    for side, runs in by_side.items():
        if runs:
            cells = [_cell([r[c] for r in runs]) for c in cols]
            seeds = ",".join(str(r["seed"]) for r in runs)
            lines.append(f"| {side} | {seeds} | " + " | ".join(cells) + " |")
    pairs = [
        (t["time_to_target_s"], o["time_to_target_s"])
        for t in by_side["TRL"]
        for o in by_side["async-grpo"]
        if t["seed"] == o["seed"] and t["time_to_target_s"] and o["time_to_target_s"]
    ]
    if pairs:
        ratios = ", ".join(f"{t / o:.2f}x" for t, o in pairs)
        lines.append(f"\nTRL's time to target over ours, per run: {ratios}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="0", help="seeds, one race each")
    ap.add_argument("--steps", type=int, default=40, help="the most steps a side runs")
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--window", type=int, default=3, help="steps in the reward's mean")
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument(
        "--trl-bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="TRL's bf16 autocast (default: where this CPU computes bf16 natively, as ours)",
    )
    ap.add_argument("--timeout-s", type=float, default=7200.0, help="per side")
    ap.add_argument("--only", choices=["TRL", "async-grpo"], help="run one side")
    ap.add_argument("--results", default=str(ROOT / "docs" / "trl-race" / "runs.jsonl"))
    ap.add_argument("--table", action="store_true", help="print the table and run nothing")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    from async_grpo.precision import native_bf16

    if args.trl_bf16 is None:
        args.trl_bf16 = native_bf16("cpu")[0]
    path = Path(args.results)
    results = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    if not args.table:
        for seed in [int(s) for s in args.runs.split(",")]:
            for record in race(args, seed):
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                results.append(record)
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
