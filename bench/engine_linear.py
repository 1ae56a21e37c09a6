"""vLLM-CPU linear layers: oneDNN (vLLM's choice) vs plain `torch.nn.functional.linear`.

    .venv/bin/python bench/engine_linear.py [--threads 1] [--reloads 3]

vLLM on CPU repacks every linear weight into a oneDNN handle after loading it, and drops
the original weight; a weight update therefore rebuilds each layer, loads it, repacks it
and copies it back (docs/weight-sync.md). With plain linear layers there is nothing to
repack: an update is `model.load_weights` writing into the weights in place. This bench
prices that trade in one process: output tokens/s (64 prompts x 48 sampled tokens, eager,
fp32 or bf16 as `auto` picks) and the seconds of one reload of every weight, each way,
and checks that a reload of the same weights leaves greedy output unchanged.

Prints one JSON line per linear kind (with the CPU kind).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def measure(kind: str, threads: int, reloads: int) -> dict[str, object]:
    os.environ |= {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the model lives in this process
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(threads),
    }
    import torch
    import vllm._custom_ops as ops
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    from async_grpo.models import in_dtype, resolve_model
    from async_grpo.precision import resolve_dtype

    if kind == "plain":
        ops._supports_onednn = False  # vLLM then falls back to torch's linear
    dtype = resolve_dtype("auto", "cpu").dtype  # as a run picks it on this CPU
    model_dir = in_dtype(resolve_model("smollm2-135m"), dtype)
    llm = LLM(
        str(model_dir),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        enable_chunked_prefill=False,
        max_num_batched_tokens=4096,
    )
    prompts = [f"What is {a} + {b}? Answer:" for a in range(8) for b in range(8)]
    sampled = SamplingParams(max_tokens=48, temperature=1.0, seed=1, ignore_eos=True)
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    llm.generate(prompts[:8], sampled, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(2):
        t = time.perf_counter()
        outs = llm.generate(prompts, sampled, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    weights = load_file(str(model_dir / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # tied (vllm_ext.py)
    model_config = llm.llm_engine.model_config

    def reload(model: torch.nn.Module) -> float:
        t = time.perf_counter()
        if kind == "onednn":
            initialize_layerwise_reload(model)
            model.load_weights(iter(weights.items()))
            finalize_layerwise_reload(model, model_config)
        else:
            model.load_weights(iter(weights.items()))
        return time.perf_counter() - t

    seconds = [llm.apply_model(reload)[0] for _ in range(reloads)]
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    return {
        "linear": kind,
        "dtype": dtype,
        "threads": threads,
        "gen_tok_s": [round(r, 1) for r in rates],
        "reload_s": [round(s, 3) for s in seconds],
        "same_greedy_output_after_reload": before == after,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reloads", type=int, default=3)
    ap.add_argument("--kind", choices=["onednn", "plain"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.kind:  # one engine per process: the switch is read when the model loads
        print(json.dumps(measure(args.kind, args.threads, args.reloads)), flush=True)
        return
    for kind in ("onednn", "plain"):
        cmd = [sys.executable, __file__, "--kind", kind, "--threads", str(args.threads)]
        r = subprocess.run(
            [*cmd, "--reloads", str(args.reloads)], capture_output=True, text=True, timeout=900
        )
        lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
        if r.returncode != 0 or not lines:
            sys.exit(f"bench/engine_linear.py: the {kind} run failed:\n{r.stderr[-3000:]}")
        print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
