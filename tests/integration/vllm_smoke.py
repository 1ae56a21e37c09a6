"""Run by test_models.py in a subprocess: load a model folder in vLLM and generate greedily."""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

if __name__ == "__main__":
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    model_dir = sys.argv[1]
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=512, seed=0)
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, logprobs=0))[
        0
    ].outputs[0]
    print(
        json.dumps(
            {
                "text": out.text,
                "n": len(out.token_ids),
                "logprobs": [next(iter(d.values())).logprob for d in out.logprobs],
            }
        )
    )
