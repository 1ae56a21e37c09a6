"""Turn prompts into token ids (`input_token_ids`): as a user turn in the model's chat
template (`prompt_format: chat`), or as plain text (`plain`, for base models)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from async_grpo.data.jsonl import Prompt
from async_grpo.errors import UserError

if TYPE_CHECKING:
    from async_grpo.config import DatasetConfig
    from async_grpo.data.table import PromptTable


def chat_token_ids(tokenizer, text: str) -> list[int]:
    """The prompt as one user turn, with the assistant's turn opened."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer versions
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def tokenize_prompts(prompts: list[Prompt], model_dir: Path, format: str = "chat") -> list[Prompt]:
    """Fill `input_token_ids` of every prompt with the templated prompt ids (`format`
    chat) or the text's own (plain; the tokenizer's BOS, if it adds one), then the
    prefill's (the start of the model's turn, e.g. "<calc>"), if any."""
    from async_grpo.models import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    if format == "chat" and not tokenizer.chat_template:
        raise UserError(
            f"model {model_dir}: no chat template for prompt_format: chat; set"
            " prompt_format=plain to use the prompts as plain text (base models)"
        )
    for p in prompts:
        if format == "chat":
            p.input_token_ids = chat_token_ids(tokenizer, p.input)
        else:
            p.input_token_ids = tokenizer(p.input).input_ids
        if p.prefill:
            p.input_token_ids += tokenizer(p.prefill, add_special_tokens=False).input_ids
    return prompts


def prepare_prompts(
    data_path: str | Path,
    model_dir: str | Path,
    max_model_len: int,
    format: str = "chat",
    dataset: DatasetConfig | None = None,
) -> PromptTable:
    """Read `data_path` in any form the `datasets` library reads, check every row, tokenize
    where needed (`format`: chat or plain) and refuse prompts that leave no room to
    generate: a memory-mapped `PromptTable` (data/table.py)."""
    from async_grpo.data.table import prepare_table

    return prepare_table(data_path, model_dir, max_model_len, format, dataset)
