"""Prompts: a data file in, validated `Prompt` records and a seeded, resumable order out.

JSONL (jsonl.py): one object per line, `input` (prompt text), `answer` (ground truth, any
JSON), optional `input_token_ids` (the templated prompt), `prefill` and `metadata`. Any
form the `datasets` library reads (forms.py: parquet, JSON, CSV, saved folders), its
columns mapped by the `dataset` config (rows.py), becomes a memory-mapped `PromptTable`
(table.py) addressed by index, as the sampler and the curriculum address prompts.
"""

from async_grpo.data.jsonl import DataError, Prompt, load_prompts, write_jsonl
from async_grpo.data.sampler import PromptSampler

__all__ = ["DataError", "Prompt", "PromptSampler", "load_prompts", "write_jsonl"]
