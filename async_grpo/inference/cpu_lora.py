"""vLLM-CPU's LoRA matmuls, one per adapter instead of one per token.

vLLM 0.32 runs LoRA on CPU through its PyTorch ops (`vllm.lora.ops.torch_ops`): each
`bgmv_*` op first gathers every token's own copy of its adapter's matrix
(`weights[indices]`, [T, out, in]) and then multiplies token by token (`einsum("bi,boi->bo")`).
A 4096-token prefill through one layer's gate/up expand copies 4096 x 1536 x 16 values
before any arithmetic: a LoRA arithmetic step took 142 s where the same step without an
adapter takes about 13 s (AVX512 EPYC, 2 cores).

The ops here compute the same sums as one matrix product per adapter present in the batch
(a batch holds one or two: the newest version and the one before it), on the token rows
that use it. Indices are taken exactly as vLLM's ops take them (-1 included, which picks
the last slot). `install()` puts them in place of vLLM's in the engine's process (imported
with our weight-transfer extension); tests/unit/test_cpu_lora.py checks them against
vLLM's own ops.
"""

from __future__ import annotations

import torch
from torch import Tensor


def per_adapter(inputs: Tensor, weights: Tensor, indices: Tensor, dtype: torch.dtype) -> Tensor:
    """out[t] = inputs[t] @ weights[indices[t]].T for every token t, in `dtype`. [T, out]"""
    if weights.dim() == 4:  # [slots, 1, out, in]
        weights = weights.squeeze(1)
    x = inputs.to(dtype)  # [T, in]
    slots = torch.unique(indices).tolist()
    if len(slots) == 1:
        return x @ weights[slots[0]].to(dtype).T
    out = x.new_empty(x.shape[0], weights.shape[1])  # [T, out]
    for slot in slots:
        rows = (indices == slot).nonzero().squeeze(1)
        out[rows] = x[rows] @ weights[slot].to(dtype).T
    return out


def _store(dst: Tensor, values: Tensor, add: bool) -> None:
    """Write `values` into the view `dst` (broadcast and cast as an assignment would), or
    add them to it."""
    if add:
        dst += values
    else:
        dst.copy_(values)


def bgmv_shrink(
    inputs: Tensor,
    lora_b_weights: Tensor,
    output_tensor: Tensor,
    lora_indices_tensor: Tensor,
    scaling: float = 1.0,
) -> None:
    outputs = per_adapter(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(
    inputs: Tensor,
    lora_b_weights: Tensor,
    output_tensor: Tensor,
    lora_indices_tensor: Tensor,
    add_inputs: bool = True,
) -> None:
    outputs = per_adapter(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common = min(outputs.shape[1], output_tensor.shape[1])  # padding may differ
    _store(output_tensor[:, :common], outputs[:limit, :common], add_inputs)


def bgmv_expand_slice(
    inputs: Tensor,
    lora_b_weights: Tensor,
    output_tensor: Tensor,
    lora_indices_tensor: Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    outputs = per_adapter(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    _store(output_tensor[:, slice_offset : slice_offset + slice_size], outputs, add_inputs)


OPS = {
    "bgmv_shrink": bgmv_shrink,
    "bgmv_expand": bgmv_expand,
    "bgmv_expand_slice": bgmv_expand_slice,
}


_VLLM: dict[str, object] = {}  # vLLM's own ops, kept by `install`


def vllm_ops() -> dict[str, object]:
    """vLLM's own ops, installed or not (what tests compare ours with)."""
    from vllm.lora.ops.torch_ops import lora_ops

    return {name: _VLLM.get(name, getattr(lora_ops, name)) for name in OPS}


def install() -> None:
    """Ours in place of vLLM's, where its CPU LoRA wrapper and its prefill (sgmv) ops call
    them. Idempotent."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for name in OPS:
        _VLLM.setdefault(name, getattr(lora_ops, name))
    for module in (lora_ops, punica_cpu):
        for name, fn in OPS.items():
            setattr(module, name, fn)
