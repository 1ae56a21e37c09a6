"""Asynchrony measured: the arithmetic run at max_off_policy_steps 0 (synchronous: generate,
then train, in turns), 1 and 2, with the engine and the trainer on disjoint cores and on
shared ones.

    python bench/async_vs_sync.py                                  # all six runs
    python bench/async_vs_sync.py --placements disjoint --lags 0,1
    python bench/async_vs_sync.py --table --plot docs/async-runs/reward-vs-time.png

Placements (docs/placement.md): `disjoint` puts the vLLM engine on the first core and the
trainer on the second (`generation.cpus`, `trainer.cpus`, one thread each), the small-scale
analogue of generation and training on GPUs of their own; `shared` is configs/arithmetic.yaml
as it is (engine 1 thread, trainer 2 threads, both on any core). Everything else (the
verifier, the batcher, Ray) runs on any core in both.

Each run is `async-grpo run configs/arithmetic.yaml` for 40 steps with held-out
evaluation once, at the end. One JSON line per run goes to --results (a run already there is
not run again), naming the CPU's kind; the table gives per run: the training time of the
40 steps (`time/elapsed` at step 40, from the first step waiting for samples), the wall
time of the whole command, time to a training reward of 0.8 (the first step whose last 3
steps average 0.8), the reward over steps 31-40, held-out greedy accuracy at version 40, the
trainer's idle share and the generation pool's busy share, the mean staleness, and each
run's speed-up over the synchronous run of its placement, and what its own work allows
(`work_bound`: the sum of each step's generation and training against the sum of their
maxima, a perfect pipeline). The plot draws the 3-step mean
reward against training time, one panel per placement. The physical limit of the speed-up
on two cores is 2x (both sides always busy).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

from _runs import idle_summary, mean, run, time_to

PLACEMENTS: dict[str, list[str]] = {  # name -> overrides of the config
    "disjoint": [
        "generation.cpus=0",
        "generation.threads=1",
        "trainer.cpus=1",
        "trainer.threads=1",
    ],
    "shared": [],
}
EVAL_AT_END = ["eval.every=40", "eval.at_start=false", "sample_every=0"]
WINDOW = 3  # steps in the reward's moving mean


def one_run(config: str, placement: str, lag: int, steps: int, out: Path) -> dict:
    """Run `placement` at `lag`; its figures and its reward curve."""
    from async_grpo.precision import cpu_kind

    folder = out / f"{placement}-lag{lag}"
    overrides = [*PLACEMENTS[placement], f"batcher.max_off_policy_steps={lag}", *EVAL_AT_END]
    wall, rows = run(config, steps, folder, *overrides)
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)  # ~2 GB a run
    train = [r for r in rows if "loss" in r]
    heldout = [r for r in rows if "eval/pass_at_1" in r]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True)
    rewards = [r["reward/mean"] for r in train]
    smooth = [sum(rewards[max(0, i - WINDOW + 1) : i + 1]) / min(i + 1, WINDOW) for i in
              range(len(rewards))]  # fmt: skip
    return {
        "placement": placement,
        "lag": lag,
        "cpu": cpu_kind(),
        "commit": commit.stdout.decode().strip(),
        "steps": len(train),
        "train_s": round(train[-1]["time/elapsed"], 1),
        "wall_s": round(wall, 1),
        "time_to_0.8_s": time_to(train, 0.8, WINDOW),
        "reward_31_40": mean(train[30:40], "reward/mean"),
        "heldout_40": round(heldout[-1]["eval/pass_at_1"], 4) if heldout else None,
        **idle_summary(train),
        **work_bound(folder),
        "staleness": mean(train, "staleness/mean"),
        "curve": [
            [round(r["time/elapsed"], 1), round(s, 4)] for r, s in zip(train, smooth, strict=True)
        ],
    }


def work_bound(folder: Path) -> dict:
    """What a run's own work allows (from its timeline.jsonl): per step, the generation
    pool's busy seconds g and the trainer's working seconds t (train, push, save). Taking
    turns costs the sum of g + t over the steps; a perfect two-stage pipeline (each step's
    generation entirely beside the training of the step before) costs the sum of max(g, t).
    Their quotient is the most any lag can gain with this work on these cores."""
    from async_grpo.timeline import read_timeline

    gen: dict[int, float] = {}
    work: dict[int, float] = {}
    for s in read_timeline(folder):
        seconds = s["end"] - s["start"]
        if s["lane"].startswith("gen-"):
            gen[s["step"]] = gen.get(s["step"], 0.0) + seconds
        elif s["lane"] == "trainer" and s["what"] in ("train", "push", "save"):
            work[s["step"]] = work.get(s["step"], 0.0) + seconds
    steps = sorted(set(gen) | set(work))
    turns = sum(gen.get(k, 0.0) + work.get(k, 0.0) for k in steps)
    pipelined = sum(max(gen.get(k, 0.0), work.get(k, 0.0)) for k in steps)
    return {
        "generation_s": round(sum(gen.values()), 1),
        "trainer_work_s": round(sum(work.values()), 1),
        "turns_s": round(turns, 1),
        "pipelined_s": round(pipelined, 1),
        "bound": round(turns / pipelined, 2),
    }


def speedups(results: list[dict]) -> dict[tuple[str, int], float | None]:
    """Each run's training time over the synchronous (lag 0) run's of its placement."""
    sync = {r["placement"]: r["train_s"] for r in results if r["lag"] == 0}
    return {
        (r["placement"], r["lag"]): (
            round(sync[r["placement"]] / r["train_s"], 2) if r["placement"] in sync else None
        )
        for r in results
    }


def table(results: list[dict]) -> str:
    """A Markdown table, one row per run."""
    cols = ["train_s", "wall_s", "time_to_0.8_s", "reward_31_40", "heldout_40"]
    cols += ["idle_fraction", "generation_busy_fraction", "staleness", "pipelined_s", "bound"]
    lines = [
        "| placement | lag | " + " | ".join(cols) + " | speed-up over lag 0 |",
        "|---" * (len(cols) + 3) + "|",
    ]
    ups = speedups(results)
    for r in results:
        cells = ["-" if r.get(c) is None else f"{r[c]:.4g}" for c in cols]
        up = ups[(r["placement"], r["lag"])]
        lines.append(
            f"| {r['placement']} | {r['lag']} | " + " | ".join(cells) + f" | {up or '-'}x |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    """Reward (3-step mean) against training time, one panel per placement, one curve per
    lag with its speed-up in the legend."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    placements = list(dict.fromkeys(r["placement"] for r in results))
    fig = Figure(figsize=(6 * len(placements), 4.2))
    FigureCanvasAgg(fig)
    ups = speedups(results)
    for i, placement in enumerate(placements):
        ax = fig.add_subplot(1, len(placements), i + 1)
        for r in sorted(
            (r for r in results if r["placement"] == placement), key=lambda r: r["lag"]
        ):
            xs, ys = zip(*r["curve"], strict=True)
            up = ups[(placement, r["lag"])]
            label = f"max_off_policy_steps {r['lag']}" + (f" ({up}x)" if up else "")
            ax.plot(xs, ys, label=label)
        ax.axhline(0.8, color="grey", linewidth=0.5, linestyle="--")
        ax.set_title(f"{placement} cores ({results[0]['cpu']})")
        ax.set_xlabel("training time (s)")
        ax.set_ylabel(f"training reward, {WINDOW}-step mean")
        ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/arithmetic.yaml")
    p.add_argument("--placements", default="disjoint,shared")
    p.add_argument("--lags", default="0,1,2")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default="outputs/bench-async")
    p.add_argument("--results", default="docs/async-runs/runs.jsonl")
    p.add_argument("--table", action="store_true", help="print the table and run nothing")
    p.add_argument("--plot", help="draw the recorded runs to this PNG or SVG")
    p.add_argument("--bound", nargs="+", metavar="RUN_DIR", help="print `work_bound` of runs")
    args = p.parse_args()
    if args.bound:
        for folder in args.bound:
            print(json.dumps({"run": folder, **work_bound(Path(folder))}))
        return
    path = Path(args.results)
    results = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    if not args.table:
        done = {(r["placement"], r["lag"]) for r in results}
        for placement in args.placements.split(","):
            for lag in [int(x) for x in args.lags.split(",")]:
                if (placement, lag) in done:
                    continue
                fig = one_run(args.config, placement, lag, args.steps, Path(args.out))
                print(json.dumps({k: v for k, v in fig.items() if k != "curve"}), flush=True)
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a") as f:
                    f.write(json.dumps(fig) + "\n")
                results.append(fig)
    print(table(results))
    if args.plot:
        plot(results, Path(args.plot))


if __name__ == "__main__":
    main()
