"""Token entropy of a model as transformers loads it, on a config's prompts: the figure a
run's step-1 `entropy` should be near (the trainer's load and forward are checked equal
to transformers' in tests/unit/test_model_families.py; this checks the whole path).

    python bench/model_entropy.py configs/gemma3-arithmetic.yaml [--prompts 16] [--samples 8]

Samples `generation.max_new_tokens` tokens at `generation.temperature` (fp32, plain or
chat prompts as the config says) and prints the mean entropy of the sampling distribution
over the sampled tokens, the quantity the trainer logs as `entropy`."""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    from transformers import AutoModelForCausalLM

    from async_grpo.data import load_prompts
    from async_grpo.data.tokenize import tokenize_prompts
    from async_grpo.models import resolve_model
    from async_grpo.precision import cpu_kind
    from async_grpo.preflight.settings import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    args = ap.parse_args()
    cfg = load_config(args.config, [])
    model_dir = resolve_model(cfg.model)
    prompts = tokenize_prompts(load_prompts(cfg.data)[: args.prompts], model_dir, cfg.prompt_format)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    total, count, t0 = 0.0, 0, time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p.input_token_ids])
        out = model.generate(
            ids,
            do_sample=True,
            temperature=cfg.generation.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=cfg.generation.max_new_tokens,
            num_return_sequences=args.samples,
            output_logits=True,
            return_dict_in_generate=True,
        )
        done = torch.zeros(args.samples, dtype=torch.bool)
        for step, logits in enumerate(out.logits):  # [S, V] each
            logp = torch.log_softmax(logits.float() / cfg.generation.temperature, -1)
            entropy = -(logp.exp() * logp).sum(-1)
            total += entropy[~done].sum().item()
            count += int((~done).sum())
            done |= out.sequences[:, ids.shape[1] + step] == model.config.eos_token_id
    print(f"cpu: {cpu_kind()}")
    print(
        f"{cfg.model}: mean token entropy {total / count:.3f} over {count} sampled tokens"
        f" ({len(prompts)} prompts x {args.samples}, {time.perf_counter() - t0:.0f} s)"
    )


if __name__ == "__main__":
    main()
