"""Apply a model's chat template to prompts and store the ids as `input_token_ids`."""

from __future__ import annotations

from pathlib import Path

from async_grpo.data.jsonl import Prompt


def chat_token_ids(tokenizer, text: str) -> list[int]:
    """The prompt as one user turn, with the assistant's turn opened."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer versions
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def tokenize_prompts(prompts: list[Prompt], model_dir: Path) -> list[Prompt]:
    """Fill `input_token_ids` of every prompt with the templated prompt ids, then the
    prefill's (the start of the model's turn, e.g. "<calc>"), if any."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for p in prompts:
        p.input_token_ids = chat_token_ids(tokenizer, p.input)
        if p.prefill:
            p.input_token_ids += tokenizer(p.prefill, add_special_tokens=False).input_ids
    return prompts


def prepare_prompts(data_path: str | Path, model_dir: Path, max_model_len: int) -> list[Prompt]:
    """Load, tokenize where needed, and refuse prompts that leave no room to generate."""
    from async_grpo.data.jsonl import DataError, load_prompts

    prompts = load_prompts(data_path)
    missing = [p for p in prompts if p.input_token_ids is None]
    if missing:
        tokenize_prompts(missing, model_dir)
    for p in prompts:
        if len(p.input_token_ids) >= max_model_len:
            raise DataError(
                f"{data_path}:{p.line}: field 'input': {len(p.input_token_ids)} prompt tokens"
                f" leave no room to generate in generation.max_model_len={max_model_len}"
            )
    return prompts
