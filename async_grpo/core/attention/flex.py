"""flex_attention with a BlockMask built from the packed row (shared prompts included).

Work and memory follow the samples, not the row: only the 128x128 blocks a sample's tokens
touch are computed. The kernel is compiled per row shape, so rows are padded up to a
multiple of `bucket` tokens (at most `max_buckets` shapes per run; `stats` reports how many
were compiled). PyTorch has no flex_attention backward on CPU: there it serves forward-only
work (the log-prob workers, tests) and runs uncompiled unless asked.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from async_grpo.core.attention.base import AttentionBackend, layer_windows, one_or_per_layer
from async_grpo.core.packing import PackedBatch, pad_to

HF_NAME = "async_grpo_flex"
BLOCK = 128  # flex_attention's block size; buckets are multiples of it
_compiled: dict[str, Any] = {}


def _kernel(compile: bool) -> Any:
    """flex_attention, compiled once per process where asked. Inside a region being compiled
    (trainer.kernels=compile) the plain function is traced into that graph, and nothing is
    created there: a new cache entry would be a side effect that activation checkpointing
    refuses to replay, and the whole layer would fall back to eager."""
    from torch.nn.attention.flex_attention import flex_attention

    if not compile or torch.compiler.is_compiling():
        return flex_attention
    if "flex" not in _compiled:
        _compiled["flex"] = torch.compile(flex_attention, dynamic=False)
    return _compiled["flex"]


def _attention_forward(
    module: torch.nn.Module,
    query: Tensor,  # [1, Hq, T, D]
    key: Tensor,  # [1, Hkv, T, D]
    value: Tensor,  # [1, Hkv, T, D]
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The function transformers calls in each attention layer (registered as HF_NAME)."""
    if dropout:
        raise ValueError("flex attention: attention dropout is not supported")
    hq, hkv = query.shape[1], key.shape[1]
    gqa = hq != hkv
    if gqa and hq & (hq - 1):  # grouped heads the kernel only takes for power-of-two counts
        key = key.repeat_interleave(hq // hkv, dim=1)  # [1, Hq, T, D]
        value = value.repeat_interleave(hq // hkv, dim=1)  # [1, Hq, T, D]
        gqa = False
    kernel = _kernel(query.is_cuda or FlexAttention.compile_on_cpu)
    cap = kwargs.get("softcap")
    score_mod = _softcap(cap) if cap else None
    out = kernel(
        query, key, value, score_mod=score_mod, block_mask=attention_mask, scale=scaling,
        enable_gqa=gqa,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None  # [1, T, Hq, D]


def _softcap(cap: float) -> Any:
    """Attention-logit soft-capping (Gemma-2) as a flex score_mod."""

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return torch.tanh(score / cap) * cap

    return score_mod


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(HF_NAME, _attention_forward)


def block_mask(batch: PackedBatch, compile: bool, window: int | None = None) -> Any:
    """The BlockMask of a packed row: causal, within a group (a sample, or a GRPO group
    with its shared prompt), and within the query's own sample or the group's prefix; with
    a sliding `window`, only keys fewer than `window` positions back."""
    from torch.nn.attention.flex_attention import create_block_mask

    device = batch.input_ids.device
    t = batch.input_ids.shape[1]
    lens = torch.tensor(batch.seq_lens, device=device)
    group = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)  # [T]
    sample = batch.sample_index  # [T]
    shared = (
        batch.shared_prefix
        if batch.shared_prefix is not None
        else torch.zeros(t, dtype=torch.bool, device=device)
    )  # [T]

    pos = batch.position_ids[0]  # [T]

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        same_group = group[q] == group[kv]
        return (q >= kv) & same_group & (shared[kv] | (sample[q] == sample[kv]))

    def windowed(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return mask_mod(b, h, q, kv) & (pos[q] - pos[kv] < window)

    fn = mask_mod if window is None else windowed
    return create_block_mask(fn, None, None, t, t, device=device, _compile=compile)


class FlexAttention(AttentionBackend):
    """Rows padded to `bucket`-token multiples; one BlockMask per row."""

    name = "flex"
    hf_implementation = HF_NAME
    supports_backward_on_cpu = False
    compile_on_cpu = False  # CPU runs the unfused kernel unless a caller sets this

    def __init__(self, max_tokens: int, pad_token_id: int = 0, max_buckets: int = 8) -> None:
        register()
        self.bucket = BLOCK * max(1, math.ceil(max_tokens / max_buckets / BLOCK))
        self.pad_token_id = pad_token_id
        self.shapes: set[int] = set()
        limit = math.ceil(max_tokens / self.bucket) + 2
        if torch._dynamo.config.recompile_limit < limit:
            torch._dynamo.config.recompile_limit = limit

    def prepare(self, batch: PackedBatch) -> PackedBatch:
        t = batch.input_ids.shape[1]
        padded = pad_to(batch, self.bucket * math.ceil(t / self.bucket), self.pad_token_id)
        self.shapes.add(padded.input_ids.shape[1])
        return padded

    def mask(self, batch: PackedBatch, dtype: Any, config: Any = None) -> Any:
        compile = batch.input_ids.is_cuda
        windows = layer_windows(config)
        return one_or_per_layer({k: block_mask(batch, compile, w) for k, w in windows.items()})

    def stats(self) -> dict[str, float]:
        return {"attention/row_shapes": float(len(self.shapes)), "attention/bucket": self.bucket}
