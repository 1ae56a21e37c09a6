"""Attention backends for packed rows, and the one place that picks one.

In: the configured choice ("auto", "sdpa", "flex", "flash"), the device, whether rows carry
shared prompts, whether gradients are needed. Out: an `AttentionBackend` (how to load the
model, how to pad a row, the `attention_mask` to pass) and the reason it was picked.
`auto`: flash-attn varlen on CUDA when installed and prompts are not shared; else
flex_attention on CUDA; dense SDPA on CPU (no flex backward there).
"""

from __future__ import annotations

from async_grpo.core.attention.base import AttentionBackend
from async_grpo.core.attention.dense import DenseAttention
from async_grpo.core.attention.flash import FlashVarlenAttention, flash_attn_installed
from async_grpo.core.attention.flex import FlexAttention

__all__ = ["AttentionBackend", "DenseAttention", "select_attention"]


def select_attention(
    requested: str, device: str, share_prompts: bool, training: bool, max_tokens: int
) -> tuple[AttentionBackend, str]:
    """The backend for `requested` on `device`, and why; ValueError for a choice that
    cannot run there (flash on CPU or with shared prompts, flex training on CPU)."""
    cuda = device.startswith("cuda")
    if requested == "auto":
        if cuda and flash_attn_installed() and not share_prompts:
            return FlashVarlenAttention(), "auto: CUDA with flash-attn installed"
        if cuda:
            why = "shared prompts" if share_prompts else "flash-attn not installed"
            return FlexAttention(max_tokens), f"auto: CUDA, {why}"
        return DenseAttention(), "auto: CPU (no flex_attention backward on CPU)"
    if requested == "flash":
        if not cuda:
            raise ValueError("attention 'flash' needs a CUDA device")
        if share_prompts:
            raise ValueError("attention 'flash' cannot express shared prompts")
        if not flash_attn_installed():
            raise ValueError("attention 'flash' needs the flash-attn package")
        return FlashVarlenAttention(), "set in the config"
    if requested == "flex":
        if training and not cuda:
            raise ValueError("attention 'flex' cannot train on CPU (no flex_attention backward)")
        return FlexAttention(max_tokens), "set in the config"
    return DenseAttention(), "set in the config"
