"""The policy under FSDP2: model, optimizer, LR schedule, full state dict.

The Hugging Face model sits inside `Policy`, whose forward returns per-token log-probs
(decoder hidden states + chunked LM head). Sharding `Policy` as the FSDP2 root keeps the
LM head weight gathered during that forward; each decoder layer is its own FSDP unit, and
with activation checkpointing each layer's forward is recomputed in the backward.

The model is built on the meta device and sharded before any weight exists; each rank
then reads only its own rows of every tensor from the safetensors files, so no rank ever
holds the whole model (peak memory per rank falls with the rank count).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from async_grpo import adapters
from async_grpo.adapters import adapter_file_name
from async_grpo.config import TrainerConfig
from async_grpo.core.attention import AttentionBackend, DenseAttention
from async_grpo.core.logprobs import batch_logprobs
from async_grpo.core.model_parts import (
    decoder_layers,
    drop_no_activations,
    output_head,
    without_dropout,
)
from async_grpo.core.packing import PackedBatch
from async_grpo.precision import Precision, resolve_dtype
from async_grpo.trainer import lora as lora_module
from async_grpo.trainer.weight_names import stored_sources

PREFIX = "hf."


class Policy(nn.Module):
    """The HF model plus how its attention isolates packed samples (`attention`), the
    compute precision it was built with and whether its layers recompute activations."""

    def __init__(
        self,
        hf_model: nn.Module,
        temperature: float,
        chunk_size: int,
        attention: AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        self.hf = hf_model
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.attention = attention or DenseAttention()
        self.precision = Precision("float32", "default")
        self.checkpointing = False
        self.fused_head = False  # the LM head's per-chunk maths as compiled kernels
        self.lora: Any = None  # trainer.lora when adapters are trained, else None
        self.adapter_config: dict[str, Any] = {}  # PEFT's adapter_config.json, resolved

    def forward(self, batch: PackedBatch, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        """Per-token log-probs of a batch already `self.attention.prepare`d."""
        return batch_logprobs(
            self.hf, batch, self.temperature, self.chunk_size, with_entropy, self.attention,
            self.fused_head,
        )  # fmt: skip


def apply_liger(hf: nn.Module) -> None:
    """Liger-Kernel's Triton RMSNorm, rotary and SwiGLU on this model instance only.

    Liger also swaps classes and the rotary function in the model's transformers module,
    which would reach every model this process builds later (a CPU one included, where
    Triton cannot run): the classes are put back, and the rotary function dispatches on the
    device. The LM head stays ours (per-token log-probs, not a loss)."""
    import sys

    from liger_kernel.transformers.monkey_patch import (
        MODEL_TYPE_TO_APPLY_LIGER_FN,
        _apply_liger_kernel_to_instance,
    )

    model_type = hf.config.model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ValueError(
            f"trainer.kernels: liger-kernel has no kernels for model type {model_type!r};"
            " use eager or compile"
        )
    module = sys.modules[type(hf).__module__]  # e.g. transformers...modeling_qwen2
    before = dict(vars(module))
    _apply_liger_kernel_to_instance(
        hf, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
        fused_linear_cross_entropy=False,
    )  # fmt: skip
    swapped = {k: v for k, v in vars(module).items() if before.get(k, v) is not v}
    for name in swapped:
        setattr(module, name, before[name])
    rope = swapped.get("apply_rotary_pos_emb")
    if rope is not None:
        module.apply_rotary_pos_emb = _on_cuda(rope, before["apply_rotary_pos_emb"])


def _on_cuda(fast: Any, plain: Any) -> Any:
    """`fast` for CUDA tensors, `plain` for any other."""

    def call(q: Tensor, *args: Any, **kwargs: Any) -> Any:
        return (fast if q.is_cuda else plain)(q, *args, **kwargs)

    return call


def wrap_layers(layers: nn.ModuleList, checkpointing: bool, compile: bool) -> None:
    """Each decoder layer's own `forward` is wrapped, so module names, FSDP units and the
    state dict stay exactly those of the Hugging Face model (FSDP2's hooks stay outside).
    `checkpointing`: recompute the forward in the backward (non-reentrant checkpoint).
    `compile`: torch.compile the (checkpointed) forward; one graph serves every layer."""
    from torch.utils.checkpoint import checkpoint

    for layer in layers:
        fn = layer.forward
        if checkpointing:
            fn = functools.partial(checkpoint, fn, use_reentrant=False)
        if compile:
            fn = torch.compile(fn, dynamic=False)
        layer.forward = fn


def build_policy(
    model_dir: str,
    cfg: TrainerConfig,
    device: torch.device,
    world_size: int,
    attention: AttentionBackend | None = None,
    seed: int = 0,
) -> Policy:
    """Load the HF model in the master dtype, optionally checkpoint its layers, shard it.

    FSDP2 casts the gathered parameters to the compute dtype (`compute_dtype`, `auto`: bf16
    only where the device computes it natively) for forward and backward, while master
    weights, optimizer state and gradient reduction stay in `dtype`. With `cfg.lora` the
    base is frozen in the compute dtype and only the adapters (drawn from `seed`) train."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    attention = attention or DenseAttention()
    config = AutoConfig.from_pretrained(model_dir)
    config.use_cache = False
    without_dropout(config)  # the log-probs are a function of the weights
    requested = cfg.compute_dtype or cfg.dtype
    if requested == "auto" and cfg.dtype != "float32":  # never compute wider than the masters
        requested = cfg.dtype
    precision = resolve_dtype(requested, device.type)
    lora = cfg.lora if cfg.lora.rank else None
    # with adapters the frozen base has no master copy: it is held in the compute dtype
    held = precision.torch_dtype if lora else getattr(torch, cfg.dtype)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(
            config, dtype=held, attn_implementation=attention.implementation(config)
        )
        adapter_config = adapters.inject(hf, lora) if lora else None
    policy = Policy(hf, cfg.loss.temperature, cfg.logprob_chunk_size, attention)
    policy.precision = precision
    if lora:
        for name, p in hf.named_parameters():
            if adapters.is_adapter(name):
                p.data = p.data.to(getattr(torch, cfg.dtype))
        policy.lora = lora
        policy.adapter_config = lora_module.adapter_config_dict(adapter_config)
    drop_no_activations(hf)
    ac = cfg.activation_checkpointing
    policy.checkpointing = device.type == "cuda" if ac is None else ac
    if cfg.kernels == "liger":
        apply_liger(hf)
    layers = decoder_layers(hf)
    wrap_layers(layers, policy.checkpointing, cfg.kernels == "compile")
    policy.fused_head = cfg.kernels != "eager"
    mesh = init_device_mesh(device.type, (world_size,))
    mp = MixedPrecisionPolicy(
        param_dtype=policy.precision.torch_dtype, reduce_dtype=getattr(torch, cfg.dtype)
    )
    # One rank: nothing to free by resharding, so the backward reuses the forward's
    # gathered (cast) parameters instead of gathering them again.
    reshard = world_size > 1
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(policy, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    policy.to_empty(device=device)
    load_shards(policy, Path(model_dir))
    if lora:
        named = [(n, p) for n, p in policy.named_parameters() if adapters.is_adapter(n)]
        lora_module.init_adapters(named, seed, _copy_rows)
    return policy


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or an indexed set)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{model_dir}: no model.safetensors(.index.json) to load")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def load_shards(policy: Policy, model_dir: Path) -> None:
    """Fill the sharded (materialised, uninitialised) policy from `model_dir`: each rank
    reads only the rows of its own dim-0 shard of every parameter (`get_slice`), then
    computes the non-persistent buffers from the config (`_compute_buffers`)."""
    from safetensors import safe_open

    files = _weight_files(model_dir)
    # tied weights appear once; adapters are not in the files (init_adapters draws them)
    params = {
        lora_module.stored_name(n).removeprefix(PREFIX): p
        for n, p in policy.named_parameters()
        if not adapters.is_adapter(n)
    }
    sources = stored_sources(policy.hf, list(params), list(files))
    missing = [n for n in params if n not in sources]
    tied = policy.hf.config.tie_word_embeddings
    head = output_head(policy.hf).weight
    if tied and all(params[n] is head for n in missing):
        missing = []  # the LM head is the (already loaded) embedding
    if missing:
        raise KeyError(f"{model_dir}: no weights for {missing[:3]}")
    by_file: dict[Path, list[tuple[str, str]]] = {}
    with torch.no_grad():
        for name, source in sources.items():
            if isinstance(source, str):
                by_file.setdefault(files[source], []).append((name, source))
            else:
                _copy_rows(params[name], lambda rows, s=source: s.load(files)[rows])
        for path, pairs in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for name, source in pairs:
                    _copy_rows(params[name], f.get_slice(source).__getitem__)
    _compute_buffers(policy.hf)
    if tied:
        policy.hf.tie_weights()


def _compute_buffers(hf: nn.Module) -> None:
    """The buffers the config determines (rotary tables of each kind, embedding scales), as
    transformers' own load computes them: every loaded tensor is marked initialised, and
    `initialize_weights` then fills only what is not (a module's `_init_weights` would
    also re-draw its loaded weights, e.g. Gemma's scaled embedding)."""
    for module in hf.modules():
        module.__dict__.pop("_is_hf_initialized", None)  # set when the model was built
        computed = module._non_persistent_buffers_set
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None:
                tensor._is_hf_initialized = name not in computed
    hf.initialize_weights()


def _copy_rows(param: Tensor, rows: Any) -> None:
    """Fill `param` (a dim-0 shard, or whole) from `rows(slice)`, which reads just those
    rows of the stored tensor."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        param.copy_(rows(slice(None)))
        return
    if tuple(param.placements) != (Shard(0),):
        raise ValueError(f"expected a dim-0 shard, got {param.placements}")
    local = param.to_local()  # [rows of this rank, ...]
    start = _shard_start(param.shape[0], param.device_mesh)
    local.copy_(rows(slice(start, start + local.shape[0])))


def _shard_start(rows: int, mesh: Any) -> int:
    """First row of this rank's dim-0 shard (torch.chunk sizes: ceil(rows / ranks))."""
    per_rank = -(-rows // mesh.size())
    return min(mesh.get_local_rank() * per_rank, rows)


def build_optimizer(policy: Policy, cfg: TrainerConfig) -> tuple[Any, Any]:
    """AdamW (one fused kernel per step on CUDA) and a linear-warmup-then-constant schedule,
    over the trained parameters (the adapters alone under LoRA)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        betas=(0.9, 0.999),
        eps=1e-8,
        fused=bool(params) and params[0].device.type == "cuda",
    )
    warmup = max(cfg.warmup_steps, 0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    return opt, sched


def full_state_dict(policy: Policy) -> dict[str, Tensor]:
    """The whole model with Hugging Face names, on CPU, on rank 0 (empty elsewhere); under
    LoRA the adapters alone, by PEFT's saved names. A collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=policy.lora is not None
    )
    sd = get_model_state_dict(policy, options=options)
    if policy.lora is not None:  # a tied head comes back even though frozen: drop it
        return {
            adapter_file_name(k.removeprefix(PREFIX)): v
            for k, v in sd.items()
            if adapters.is_adapter(k)
        }
    return {k.removeprefix(PREFIX): v for k, v in sd.items()}


def scale_grads(policy: Policy, factor: float) -> None:
    for p in policy.parameters():
        if p.grad is not None:
            p.grad.mul_(factor)
