"""Prompts: JSONL in, validated `Prompt` records and a seeded, resumable order out.

Schema, one JSON object per line: `input` (prompt text), `answer` (ground truth, any JSON),
optional `input_token_ids` (list of ints, the chat-templated prompt) and `metadata`.
"""

from async_grpo.data.jsonl import DataError, Prompt, load_prompts, write_jsonl
from async_grpo.data.sampler import PromptSampler

__all__ = ["DataError", "Prompt", "PromptSampler", "load_prompts", "write_jsonl"]
