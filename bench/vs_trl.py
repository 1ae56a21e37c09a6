"""The race: TRL's GRPOTrainer vs async-grpo, one after the other, same everything.

    .venv/bin/python bench/vs_trl.py [--steps 4] [--questions 8] [--group 8] [--max-new-tokens 48]

Same machine, model (SmolLM2-135M-Instruct), prompts (the first steps x questions rows of
sample-data/arithmetic.jsonl, chat template applied by each side), group size, completion
length, temperature, learning rate, number of optimizer steps, and reward (async-grpo's
`last_number`, imported by the TRL job too). TRL runs in its own venv (bench/setup_trl.sh,
same torch and transformers) with its CPU defaults: HF `generate`, and bf16 autocast
exactly where our `auto` computes in bf16 (CPUs with native bf16 units); on an AVX2-only
CPU both sides compute in fp32, since bf16 is emulated there (--trl-bf16/--no-trl-bf16
force it). async-grpo runs `async-grpo run configs/arithmetic.yaml` with the matching
overrides. The CPU kind and each side's dtype are printed with the figures.

Printed: samples/hour for each side over the training itself (TRL: `trainer.train()`;
async-grpo: the sum of its steps' wall time, from the first step waiting for samples to the
last optimizer step), the same end to end (process start to exit, model loading and engine
start included), and the ratios. Goal: async-grpo >= 5x TRL.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "sample-data" / "arithmetic.jsonl"


def run_trl(args: argparse.Namespace, model_dir: str, work: Path) -> dict:
    subprocess.run(["bash", str(ROOT / "bench" / "setup_trl.sh")], check=True)
    spec = {
        "model": model_dir,
        "data": str(DATA),
        "output_dir": str(work / "trl"),
        "steps": args.steps,
        "questions": args.questions,
        "group": args.group,
        "max_new_tokens": args.max_new_tokens,
        "temperature": 1.0,
        "lr": args.lr,
        "bf16": args.trl_bf16,
    }
    (work / "trl_spec.json").write_text(json.dumps(spec))
    out = work / "trl_result.json"
    t0 = time.perf_counter()
    subprocess.run(
        [
            str(ROOT / ".venv-trl" / "bin" / "python"),
            str(ROOT / "bench" / "trl_grpo_job.py"),
            "--spec",
            str(work / "trl_spec.json"),
            "--out",
            str(out),
        ],
        check=True,
        timeout=args.timeout_s,
    )
    result = json.loads(out.read_text())
    result["end_to_end_s"] = time.perf_counter() - t0
    result["dtype"] = "bfloat16 autocast" if args.trl_bf16 else "float32"
    return result


def run_ours(args: argparse.Namespace, work: Path) -> dict:
    out_dir = work / "async_grpo"
    overrides = [
        f"output_dir={out_dir}",
        f"trainer.max_steps={args.steps}",
        f"batcher.questions_per_step={args.questions}",
        f"batcher.samples_per_question={args.group}",
        f"generation.max_new_tokens={args.max_new_tokens}",
        f"trainer.lr={args.lr}",
        "batcher.seed=0",
        "eval.data=null",  # TRL evaluates nothing either
        "sample_every=0",
    ]
    t0 = time.perf_counter()
    subprocess.run(
        [
            str(ROOT / ".venv" / "bin" / "async-grpo"),
            "run",
            str(ROOT / "configs" / "arithmetic.yaml"),
        ]
        + overrides,
        check=True,
        timeout=args.timeout_s,
    )
    end_to_end = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out_dir / "training_metrics.jsonl").open()]
    records = [r for r in rows if "time/step" in r]  # training steps, not evaluations
    return {
        "seconds": sum(r["time/step"] for r in records),
        "dtype": json.loads((out_dir / "training_params.json").read_text())["resolved"][
            "trainer_compute_dtype"
        ].split()[0],
        "samples": int(records[-1]["samples_seen"]),
        "reward_first": records[0]["reward/mean"],
        "reward_last": records[-1]["reward/mean"],
        "end_to_end_s": end_to_end,
    }


def per_hour(result: dict, key: str) -> float:
    return result["samples"] / result[key] * 3600.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
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
    ap.add_argument("--only", choices=["trl", "async-grpo"], help="run one side")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    from async_grpo.models import resolve_model
    from async_grpo.precision import cpu_kind, native_bf16

    if args.trl_bf16 is None:
        args.trl_bf16 = native_bf16("cpu")[0]
    model_dir = str(resolve_model("smollm2-135m"))
    results = {}
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        work = Path(tmp)
        if args.only != "async-grpo":
            results["TRL"] = run_trl(args, model_dir, work)
        if args.only != "trl":
            results["async-grpo"] = run_ours(args, work)
    print(
        f"race: {args.steps} steps x {args.questions} questions x {args.group} samples,"
        f" <= {args.max_new_tokens} new tokens, SmolLM2-135M, lr {args.lr}; CPU {cpu_kind()}"
    )
    for name, r in results.items():
        print(
            f"{name:>10}: {per_hour(r, 'seconds'):8.0f} samples/hour training"
            f" ({r['samples']} samples in {r['seconds']:.0f} s),"
            f" {per_hour(r, 'end_to_end_s'):8.0f} samples/hour end to end"
            f" ({r['end_to_end_s']:.0f} s); reward {r['reward_first']:.3f} -> {r['reward_last']:.3f};"
            f" computes in {r['dtype']}"
        )
    if len(results) == 2:
        ours, trl = results["async-grpo"], results["TRL"]
        print(
            f"ratio async-grpo / TRL: {per_hour(ours, 'seconds') / per_hour(trl, 'seconds'):.2f}x"
            f" training, {per_hour(ours, 'end_to_end_s') / per_hour(trl, 'end_to_end_s'):.2f}x"
            " end to end"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
