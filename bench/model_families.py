"""Per model family, a whole `async-grpo run` of a tiny random model: exit code, the
sampler-vs-trainer mismatch at steps 1-3 and the push time. With `--check`, instead, the
start-up check (async_grpo/preflight/family.py) on every model type that both transformers and
vLLM serve, from the type's default config: what a run of that family is told before Ray.

    python bench/model_families.py [--families gemma2,qwen3_moe] [--out outputs/families]
    python bench/model_families.py --check

Each family's model comes from async_grpo/model_families.py (SmolLM2's tokenizer, 2
layers of width 128, windows of 16). The run is configs/arithmetic.yaml, on-policy
(`batcher.max_off_policy_steps=0`, so `mismatch_abs_mean` holds only the engine's and the
trainer's numerics and the push), fp32, lr 1e-3, no evaluation, rewarded by the parity of
the completion's length: about half the samples score 1, so the weights move every step.
Prints one row per family and a JSON line of every figure (docs/models.md)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent


def run_family(family: str, out: Path, steps: int) -> dict:
    from async_grpo.model_families import make_family_model
    from async_grpo.models import prepare_smollm2

    shutil.rmtree(out, ignore_errors=True)
    model = make_family_model(family, out / "model", prepare_smollm2(), seed=0)
    cmd = [sys.executable, "-m", "async_grpo.cli", "run", str(REPO / "configs/arithmetic.yaml")]
    cmd += [
        f"model={model}",
        f"output_dir={out / 'run'}",
        f"trainer.max_steps={steps}",
        "batcher.max_off_policy_steps=0",
        "trainer.lr=1e-3",
        "eval.data=null",
        "generation.dtype=float32",
        "trainer.dtype=float32",
        "trainer.compute_dtype=float32",
        "logprob.dtype=float32",
        "verifier.rewards=[_family_reward:parity]",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(BENCH), os.environ.get("PYTHONPATH", "")]),
    }
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    metrics = out / "run" / "training_metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    last = (r.stdout + r.stderr).strip().splitlines()[-1:] if r.returncode else []
    return {
        "family": family,
        "exit": r.returncode,
        "mismatch": [r_.get("mismatch_abs_mean") for r_ in rows],
        "push_s": [round(r_["time/weight_push"], 3) for r_ in rows if "time/weight_push" in r_],
        "reward": [round(r_["reward/mean"], 3) for r_ in rows],
        "wall_s": round(wall, 1),
        "last_line": last[0] if last else "",
    }


def check_all() -> None:
    """One row per model type served by both: ok, or the one line a run would refuse with,
    for the dense path (the CPU trainer) and the flex path (the log-prob workers, CUDA)."""
    import time
    import warnings

    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from async_grpo.core.attention import DenseAttention
    from async_grpo.core.attention.base import layer_windows
    from async_grpo.core.attention.flex import FlexAttention
    from async_grpo.preflight.family import family_problem
    from async_grpo.preflight.model import vllm_architectures

    warnings.filterwarnings("ignore")
    served = vllm_architectures()
    kinds = sorted(
        kind
        for kind, arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()
        if (arch if isinstance(arch, str) else arch[0]) in served
    )
    counts = {"dense": 0, "flex": 0}
    for kind in kinds:
        t0 = time.perf_counter()
        row = []
        for attention in (DenseAttention(), FlexAttention(max_tokens=256)):
            try:
                config = AutoConfig.for_model(kind)
                layer_windows(config)
                problem = family_problem(config, [attention])
            except Exception as e:  # a config transformers cannot build, an unknown layer type
                problem = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
            name = "dense" if isinstance(attention, DenseAttention) else "flex"
            counts[name] += problem is None
            row.append(f"{name} {'ok' if problem is None else 'refused: ' + problem[:150]}")
        print(f"{kind:18s} {time.perf_counter() - t0:5.1f} s  " + " | ".join(row), flush=True)
    print(f"{len(kinds)} model types; exact on the dense path: {counts['dense']},", end=" ")
    print(f"on the flex path: {counts['flex']}; the rest refused before Ray")


def main() -> None:

    from async_grpo.model_families import FAMILIES
    from async_grpo.precision import cpu_kind

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "families")
    ap.add_argument("--check", action="store_true", help="the start-up check of every type")
    args = ap.parse_args()
    print(f"cpu: {cpu_kind()}", flush=True)
    if args.check:
        check_all()
        return
    results = []
    for family in args.families.split(","):
        res = run_family(family, args.out / family, args.steps)
        results.append(res)
        fmt = " / ".join(f"{m:.1e}" if m is not None else "-" for m in res["mismatch"]) or "-"
        push = max(res["push_s"], default=float("nan"))
        print(
            f"{family:12s} exit {res['exit']}  mismatch {fmt}  push max {push:.2f} s"
            f"  wall {res['wall_s']:.0f} s  {res['last_line'][:120]}",
            flush=True,
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
