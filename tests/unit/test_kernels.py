"""trainer.kernels on the CPU: `compile` compiles one graph that every decoder layer shares,
with no graph break (checkpointed or not, dense or flex attention), and gives eager's
log-probs and gradients; `liger` leaves other models of the process as they were."""

from __future__ import annotations

import pytest
import torch
from _dist import one_rank_group
from _tiny import tiny_llama

from async_grpo.config import TrainerConfig
from async_grpo.core.attention import DenseAttention, select_attention
from async_grpo.core.attention.flex import FlexAttention
from async_grpo.core.logprobs import batch_logprobs
from async_grpo.core.packing import PackInput, pack
from async_grpo.trainer.model import build_policy, wrap_layers


def _samples() -> list[PackInput]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n_prompt, n_out in ((30, 50), (12, 70), (40, 20)):
        prompt = torch.randint(1, 49152, (n_prompt,), generator=g).tolist()
        completion = torch.randint(1, 49152, (n_out,), generator=g).tolist()
        out.append(PackInput(prompt, completion, 1.0, [0.0] * n_out))
    return out


def _dynamo_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@pytest.mark.parametrize("checkpointing", [True, False])
def test_compiled_layers_give_eager_logprobs_and_grads(tmp_path, checkpointing):
    tiny_llama(seed=5).save_pretrained(tmp_path)
    batch = pack(_samples())
    got = {}
    with one_rank_group():
        for kernels in ("eager", "compile"):
            cfg = TrainerConfig(
                activation_checkpointing=checkpointing, kernels=kernels, compute_dtype="float32"
            )
            policy = build_policy(str(tmp_path), cfg, torch.device("cpu"), 1, DenseAttention())
            graphs, breaks = _dynamo_counts()
            logp, ent = policy(batch, True)
            (logp.sum() + ent.sum()).backward()
            grads = {n: p.grad.full_tensor() for n, p in policy.named_parameters()}
            got[kernels] = (logp.detach(), ent.detach(), grads)
            new_graphs, new_breaks = _dynamo_counts()
            if kernels == "compile":
                # one graph for both layers, two for the LM head's chunk maths
                assert new_graphs - graphs <= 3 and new_breaks == breaks
    (logp, ent, grads), (c_logp, c_ent, c_grads) = got["eager"], got["compile"]
    torch.testing.assert_close(c_logp, logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c_ent, ent, rtol=1e-5, atol=1e-5)
    assert c_grads.keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(c_grads[name], g, rtol=1e-4, atol=1e-5, msg=name)


def test_flex_inside_a_compiled_checkpointed_layer_does_not_break(monkeypatch):
    """The layer that compiles whole on CUDA: checkpoint around it, flex inside it (the
    forward, which CPU flex has). A graph break there ran every layer eagerly on an H200."""
    monkeypatch.setattr(FlexAttention, "compile_on_cpu", True)
    backend, _ = select_attention("flex", "cpu", False, False, 1024)
    batch = backend.prepare(pack(_samples()))
    want_model = tiny_llama(seed=6, attn_implementation=backend.hf_implementation)
    model = tiny_llama(seed=6, attn_implementation=backend.hf_implementation)
    wrap_layers(model.model.layers, checkpointing=True, compile=True)
    with torch.no_grad():
        want, _ = batch_logprobs(want_model, batch, attention=backend)
        graphs, breaks = _dynamo_counts()
        logp, _ = batch_logprobs(model, batch, attention=backend)
    new_graphs, new_breaks = _dynamo_counts()
    assert new_breaks == breaks and new_graphs - graphs == 1
    torch.testing.assert_close(logp, want, rtol=1e-5, atol=1e-5)


def test_liger_changes_this_model_only():
    """Liger swaps classes and the rotary function module-wide; a CPU model built after it
    must still run (Triton cannot), and build with the Hugging Face classes."""
    pytest.importorskip("liger_kernel")
    pytest.importorskip("triton")
    from transformers.models.llama import modeling_llama

    from async_grpo.trainer.model import apply_liger

    classes = (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP)
    patched = tiny_llama(seed=7)
    apply_liger(patched)
    assert type(patched.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert patched.model.layers[0].mlp._get_name() == "LigerSwiGLUMLP"
    assert (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP) == classes
    later = tiny_llama(seed=7)  # built after the patch, on the CPU
    batch = pack(_samples())
    logp, _ = batch_logprobs(later, batch)
    assert torch.isfinite(logp).all()
    assert type(later).__module__ == modeling_llama.__name__
    assert "liger" not in modeling_llama.LlamaRMSNorm.__module__
