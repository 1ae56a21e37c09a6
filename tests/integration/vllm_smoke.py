"""Run by test_models.py in a subprocess: load a model folder in vLLM, generate greedily in
the given dtype, print the completion's token ids and per-token log-probs as JSON."""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

if __name__ == "__main__":
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    model_dir, dtype = sys.argv[1], sys.argv[2]
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, max_model_len=512, seed=0)
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt_ids}], params)[0].outputs[0]
    print(
        json.dumps(
            {
                "prompt_ids": list(prompt_ids),
                "token_ids": list(out.token_ids),
                "text": out.text,
                "logprobs": [
                    d[t].logprob for t, d in zip(out.token_ids, out.logprobs, strict=True)
                ],
            }
        )
    )
