"""Low-rank adapters on the trainer's policy, through PEFT (`trainer.lora`).

PEFT injects its LoRA layers into the Hugging Face model in place (`inject_adapter_in_model`),
so the model keeps its class, its forward and its module tree: a wrapped linear layer
`q_proj` becomes `q_proj.base_layer` (the frozen weight) beside `q_proj.lora_A.default` and
`q_proj.lora_B.default` (the trained factors). Each layer computes
`base(x) + (alpha / r) * B(A(dropout(x)))`.

The base is frozen and held in the compute dtype (no gradient, no optimizer state, no
master copy); the factors keep the trainer's master dtype. Names cross three layouts:
- the trainer's parameter: `model.layers.0.self_attn.q_proj.base_layer.weight`,
  `...q_proj.lora_A.default.weight`;
- the model's files (what the base is loaded from, what a merged push sends):
  `model.layers.0.self_attn.q_proj.weight`;
- PEFT's adapter files (what an adapter push sends, what vLLM's LoRA loader reads):
  `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from async_grpo.config import LoraConfig


def stored_name(name: str) -> str:
    """The files' name of a base parameter (`q_proj.base_layer.weight` -> `q_proj.weight`)."""
    return name.replace(".base_layer.", ".")


def scale(cfg: LoraConfig) -> float:
    return cfg.alpha / cfg.rank


def init_adapters(named: list[tuple[str, Tensor]], seed: int, copy_rows: Any) -> None:
    """Give every factor PEFT's starting values: A as `nn.Linear` draws it (Kaiming uniform,
    a=sqrt(5)), B zero, so the adapted model starts as the base. Each whole factor is drawn
    from one generator in parameter order, so every rank and every world size draws the
    same numbers; `copy_rows(param, rows)` fills this rank's shard."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in named:
            if ".lora_B." in name:
                full = torch.zeros(p.shape, dtype=p.dtype)
            elif ".lora_A." in name:
                full = torch.empty(p.shape, dtype=torch.float32)
                bound = 1.0 / math.sqrt(p.shape[1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]
                full.uniform_(-bound, bound, generator=gen)
                full = full.to(p.dtype)
            else:
                continue
            copy_rows(p, lambda rows, f=full: f[rows])


@contextlib.contextmanager
def adapters_off(hf: nn.Module) -> Iterator[None]:
    """The base model alone inside the block: every LoRA layer skips its adapter.

    PEFT's own switch (`enable_adapters(False)`) also sets the factors' `requires_grad`
    off and on again, and FSDP2 fixes each unit's gradient dtypes from the parameters
    that require grad at its first forward: a first forward with the adapters off left
    bf16 gradients on fp32 factors. So the layers' flag that switch sets is set alone."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in hf.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False


def adapter_config_dict(config: Any) -> dict[str, Any]:
    """PEFT's config as the JSON its `save_pretrained` writes (sets as sorted lists)."""
    out = {}
    for key, value in config.to_dict().items():
        if isinstance(value, set):
            value = sorted(value)
        elif hasattr(value, "value"):  # enums (peft_type, task_type)
            value = value.value
        out[key] = value
    return out
