"""What a full-weight push does to vLLM's model inside the engine's worker process: whether
the update writes in place, the fused-experts layers' repacking, the head a model has, and
the tensors vLLM still holds of a reused slot (the `weights` push kind's helpers).

With `generation.cpu_linear: torch` a CPU engine keeps plain linear layers (vLLM falls back
to `torch.nn.functional.linear` when oneDNN is switched off before the model loads), so
nothing is repacked and every weight stays in place: an update is then vLLM's loader
writing into those weights, without the layerwise rebuild."""

from __future__ import annotations

import os

import torch

from async_grpo.inference.types import CPU_LINEAR_ENV

PLAIN_LINEAR = os.environ.get(CPU_LINEAR_ENV) == "torch"


HEAD = "lm_head.weight"


def has_head(model: torch.nn.Module) -> bool:
    """Whether vLLM's `model` has an `lm_head.weight` parameter (its own, or tied to the
    embedding). The trainer sends a tied head under both names; an engine whose model
    family computes logits from the embedding itself (Gemma) takes only the embedding."""
    cached = getattr(model, "_async_grpo_has_head", None)
    if cached is None:
        cached = HEAD in dict(model.named_parameters(remove_duplicate=False))
        model._async_grpo_has_head = cached
    return cached


def reloads_in_place(model: torch.nn.Module) -> bool:
    """Whether an update writes into the weights where they are: plain linear layers were
    asked for and every weight is still a plain tensor of the model (nothing repacked away).
    A model with a quantized or otherwise processed layer keeps the layerwise reload."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    if not PLAIN_LINEAR:
        return False
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and "Unquantized" not in type(method).__name__:
            return False
        if getattr(method, "moe_kernel", None) is not None:
            return False  # fused experts: their kernel holds its own layout (CPU: prepacked)
        if isinstance(method, UnquantizedLinearMethod) and module.weight.numel() == 0:
            return False  # repacked: vLLM dropped the weight
    return True


def prepack_experts_on_update(model: torch.nn.Module) -> None:
    """Make every fused-experts layer of `model` redo its kernel's own post-load step
    (vLLM-CPU: pad and prepack into its grouped-GEMM layout) when an update reloads it.

    vLLM 0.32 runs that step only at the first load: on an update,
    `UnquantizedFusedMoEMethod._setup_kernel` copies the freshly loaded weights in and
    skips `fused_experts.process_weights_after_loading`, so the CPU kernel reads plain
    weights as prepacked ones (a Qwen3-MoE engine's log-probs moved by up to 0.06 nats
    after a push of the very weights it had loaded). Wrapped once per layer; idempotent."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if kernel is None or getattr(method, "_async_grpo_prepacks", False):
            continue
        experts = getattr(kernel, "fused_experts", None)
        post_load = getattr(type(experts), "process_weights_after_loading", None)
        if post_load in (None, FusedMoEExperts.process_weights_after_loading):
            continue  # this kernel reads the weights as loaded
        setup = method._setup_kernel

        def setup_then_prepack(layer, w13, w2, _setup=setup, _experts=experts):
            _setup(layer=layer, w13=w13, w2=w2)
            _experts.process_weights_after_loading(layer)

        method._setup_kernel = setup_then_prepack
        method._async_grpo_prepacks = True


def own_pending(flat: torch.Tensor) -> None:
    """Copy what vLLM still holds of `flat` before the trainer reuses its slot.

    vLLM buffers a layer's tensors until the layer is complete. Chunks hold whole layers,
    so this finds nothing unless a layer loads fewer elements than it allocates (padded
    vocabularies), whose tensors wait for `finish_weight_update`."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    ptr = flat.untyped_storage().data_ptr()
    for info in list(LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == ptr:
                    bound.arguments[key] = value.clone()
