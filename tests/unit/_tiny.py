"""A tiny random Llama (vocab and head size of SmolLM2) for fast CPU tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(
    seed: int = 0, attn_implementation: str = "sdpa", tie_word_embeddings: bool = False
) -> LlamaForCausalLM:
    """2 layers, hidden 64, one head of size 64, vocab 49152; float32, eval mode, seeded."""
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(
        config, attn_implementation=attn_implementation, dtype=torch.float32
    )
    return model.eval()
