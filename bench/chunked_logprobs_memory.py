"""Peak memory of per-token log-probs, chunked vs unchunked, forward + backward.

One packed row of 16k tokens, SmolLM2-135M's LM head (hidden 576, vocab 49152), fp32 on CPU.
Each mode runs in a fresh subprocess and reports its peak RSS (`ru_maxrss`):
  baseline  inputs and their gradient buffers only (what any mode must hold)
  full      logits = hidden @ W.T, log_softmax over [T, V], gather, backward
  chunked   async_grpo.core.logprobs.logprobs_from_hidden (LM head per chunk, checkpointed)

    python bench/chunked_logprobs_memory.py [--tokens 16384] [--chunk-size 1024] [--entropy]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

HIDDEN, VOCAB = 576, 49152


def run_mode(mode: str, tokens: int, chunk_size: int, entropy: bool) -> dict[str, float]:
    """Run one mode in this process; return its peak RSS (MiB) and seconds."""
    import torch

    from async_grpo.core.logprobs import logprobs_from_hidden

    torch.manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, requires_grad=True)  # [T, H]
    weight = (torch.randn(VOCAB, HIDDEN) * 0.02).requires_grad_()  # [V, H]
    targets = torch.randint(0, VOCAB, (tokens,))  # [T]
    start = time.perf_counter()
    if mode == "baseline":
        hidden.grad, weight.grad = torch.zeros_like(hidden), torch.zeros_like(weight)
    elif mode == "full":
        logp_all = torch.log_softmax((hidden @ weight.T).float(), dim=-1)  # [T, V]
        loss = logp_all.gather(-1, targets[:, None]).sum()
        if entropy:
            loss = loss - (logp_all.exp() * logp_all).sum()
        loss.backward()
    elif mode == "chunked":
        logp, ent = logprobs_from_hidden(
            hidden, weight, targets, chunk_size=chunk_size, with_entropy=entropy
        )
        loss = logp.sum() + (ent.sum() if ent is not None else 0.0)
        loss.backward()
    else:
        raise ValueError(f"unknown mode {mode!r}; expected baseline, full or chunked")
    seconds = time.perf_counter() - start
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"mode": mode, "peak_mib": peak_mib, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--entropy", action="store_true", help="also compute the entropy")
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # set in the child process
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.tokens, args.chunk_size, args.entropy)))
        return
    results = {}
    for mode in ("baseline", "chunked", "full"):
        cmd = [sys.executable, __file__, "--mode", mode, "--tokens", str(args.tokens)]
        cmd += ["--chunk-size", str(args.chunk_size)] + (["--entropy"] if args.entropy else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
        r = results[mode]
        print(f"{mode:>8}: peak RSS {r['peak_mib']:8.0f} MiB  ({r['seconds']:.1f} s)", flush=True)
    base = results["baseline"]["peak_mib"]
    full, chunked = results["full"]["peak_mib"] - base, results["chunked"]["peak_mib"] - base
    print(
        f"T={args.tokens} H={HIDDEN} V={VOCAB} chunk={args.chunk_size} entropy={args.entropy}\n"
        f"above baseline: full {full:.0f} MiB, chunked {chunked:.0f} MiB, "
        f"ratio {full / max(chunked, 1.0):.1f}x (whole process: "
        f"{results['full']['peak_mib'] / results['chunked']['peak_mib']:.1f}x)"
    )


if __name__ == "__main__":
    main()
