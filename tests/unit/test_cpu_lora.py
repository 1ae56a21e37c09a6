"""Our CPU LoRA ops (inference/cpu_lora.py) against vLLM's own torch ops: the same outputs
for batches of tokens spread over several adapter slots, -1 included."""

from __future__ import annotations

import pytest
import torch

from async_grpo.inference import cpu_lora


def _case(slots_used: list[int], tokens: int = 37, d_in: int = 48, d_out: int = 80, r: int = 8):
    gen = torch.Generator().manual_seed(len(slots_used) * 7 + tokens)
    indices = torch.tensor([slots_used[i % len(slots_used)] for i in range(tokens)])
    indices = indices[torch.randperm(tokens, generator=gen)]
    a = torch.randn(4, 1, r, d_in, generator=gen, dtype=torch.bfloat16)  # [slots, 1, r, in]
    b = torch.randn(4, 1, d_out, r, generator=gen, dtype=torch.bfloat16)  # [slots, 1, out, r]
    x = torch.randn(tokens, d_in, generator=gen, dtype=torch.bfloat16)
    h = torch.randn(tokens, r, generator=gen, dtype=torch.float32)
    return indices, a, b, x, h


@pytest.mark.parametrize("slots_used", [[2], [0, 3], [1, -1, 2]], ids=["one", "two", "three"])
def test_ops_equal_vllms(slots_used):
    from types import SimpleNamespace

    indices, a, b, x, h = _case(slots_used)
    for ours, theirs in ((cpu_lora, SimpleNamespace(**cpu_lora.vllm_ops())),):
        out_ours = torch.zeros(len(indices), a.shape[2])
        out_theirs = out_ours.clone()
        ours.bgmv_shrink(x, a, out_ours, indices, 0.5)
        theirs.bgmv_shrink(x, a, out_theirs, indices, 0.5)
        torch.testing.assert_close(out_ours, out_theirs, rtol=1e-5, atol=1e-5)
        y_ours = torch.ones(len(indices), b.shape[2], dtype=torch.bfloat16)
        y_theirs = y_ours.clone()
        ours.bgmv_expand(h, b, y_ours, indices, True)
        theirs.bgmv_expand(h, b, y_theirs, indices, True)
        torch.testing.assert_close(y_ours, y_theirs, rtol=0, atol=0)
        z_ours = torch.zeros(len(indices), 3 * b.shape[2], dtype=torch.bfloat16)
        z_theirs = z_ours.clone()
        ours.bgmv_expand_slice(h, b, z_ours, indices, b.shape[2], b.shape[2], False)
        theirs.bgmv_expand_slice(h, b, z_theirs, indices, b.shape[2], b.shape[2], False)
        torch.testing.assert_close(z_ours, z_theirs, rtol=0, atol=0)
        assert z_ours[:, b.shape[2] : 2 * b.shape[2]].abs().sum() > 0


def test_install_reaches_the_prefill_ops():
    """vLLM's prefill ops (sgmv_*) call the decode ops by their module's names: after
    `install` they call ours."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    cpu_lora.install()
    assert lora_ops.bgmv_expand is cpu_lora.bgmv_expand
    assert punica_cpu.bgmv_shrink is cpu_lora.bgmv_shrink
    indices, a, b, x, h = _case([1, 2])
    seq_lens = torch.tensor([20, 17])
    out = torch.zeros(37, a.shape[2])
    lora_ops.sgmv_shrink(x, a, out, None, seq_lens, torch.tensor([1, 2]), 2, 20, 37, 1.0)
    want = torch.cat([x[:20].float() @ a[1, 0].float().T, x[20:].float() @ a[2, 0].float().T])
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
