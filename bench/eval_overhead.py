"""What held-out evaluation costs training: the same run with and without `eval`.

    .venv/bin/python bench/eval_overhead.py [--config configs/arithmetic.yaml] [--steps 40]

Runs `async-grpo run CONFIG` twice on this machine, eval off then on (as configured), and
prints one JSON line per run and a last line comparing them, each naming this CPU's kind:
wall time, the trainer's idle time (waiting for samples, for generation before a push, and
for an evaluation before a push: `time/wait` + `time/wait_generated` +
`time/hooks_before_push`) as a fraction of the summed step time, and the eval rows
(pass@1 per version, seconds per evaluation, trainer seconds spent waiting for each).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _runs import idle_summary, run


def one_run(config: str, steps: int, out: Path, with_eval: bool) -> dict:
    wall, rows = run(config, steps, out, *([] if with_eval else ["eval.data=null"]))
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/policy_version" in r]
    return {
        "eval": with_eval,
        "steps": len(train),
        "wall_s": round(wall, 1),
        **idle_summary(train),
        "eval_wait_s": round(sum(r.get("time/hooks_before_push", 0.0) for r in train), 1),
        "reward_last10": round(sum(r["reward/mean"] for r in train[-10:]) / len(train[-10:]), 3),
        "evals": [
            {
                "version": r["step"],
                "pass@1": r.get("eval/pass_at_1"),
                "seconds": round(r["eval/seconds"], 1),
                "trainer_wait_s": round(r["eval/trainer_wait_s"], 2),
            }
            for r in evals
        ],
    }


def main() -> None:
    from async_grpo.precision import cpu_kind

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/arithmetic.yaml")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default="outputs/bench-eval")
    p.add_argument("--only", choices=("off", "on"), default=None, help="one of the two runs")
    args = p.parse_args()
    kind = cpu_kind()
    runs = {}
    for with_eval in (False, True):
        if args.only and args.only != ("on" if with_eval else "off"):
            continue
        out = Path(args.out) / ("eval" if with_eval else "no-eval")
        runs[with_eval] = one_run(args.config, args.steps, out, with_eval)
        print(json.dumps({"cpu": kind, **runs[with_eval]}), flush=True)
    if len(runs) == 2:
        off, on = runs[False], runs[True]
        print(
            json.dumps(
                {
                    "cpu": kind,
                    "idle_fraction_without_eval": off["idle_fraction"],
                    "idle_fraction_with_eval": on["idle_fraction"],
                    "wall_ratio": round(on["wall_s"] / off["wall_s"], 3),
                    "eval_wait_share_of_steps": round(on["eval_wait_s"] / on["step_s"], 4),
                }
            )
        )


if __name__ == "__main__":
    main()
