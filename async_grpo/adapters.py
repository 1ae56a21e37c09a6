"""LoRA adapters: PEFT's layers on a model, its folder format and tensor names, merging.

An adapter folder holds `adapter_model.safetensors` (tensors by PEFT's saved names,
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`) and
`adapter_config.json` (r, lora_alpha, target_modules, ...): what PEFT writes and what
vLLM's LoRA loader reads. The trainer writes one into each adapter checkpoint; a
generation worker writes one per pushed version (under /dev/shm) and serves it under its
own name; `async-grpo export` merges one into its base model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it computes: `async-grpo --help` does not load it
    from torch import Tensor, nn

from async_grpo.config import LoraConfig

ADAPTER_NAME = "default"  # PEFT's name for the one adapter we train
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


def peft_config(cfg: LoraConfig) -> Any:
    """PEFT's LoraConfig for `cfg` (`all-linear`: every linear layer but the LM head)."""
    from peft import LoraConfig as PeftLoraConfig

    targets = cfg.target_modules
    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules="all-linear" if targets == ["all-linear"] else list(targets),
        bias="none",
    )


def inject(hf: nn.Module, cfg: LoraConfig) -> Any:
    """Add the adapters to `hf` in place (on any device, meta included); every other
    parameter is frozen. Returns PEFT's config with the target modules resolved.

    Only the decoder layers' linear modules take an adapter: the trainer computes the LM
    head from its base weight (core/logprobs.py, chunked), so an adapter there would never
    train and the log-probs would not be the adapted model's; vLLM and the checkpoint
    loader take none on the embedding either. A target PEFT places anywhere else is a
    `ValueError` naming it."""
    from peft import inject_adapter_in_model

    config = peft_config(cfg)
    try:
        inject_adapter_in_model(config, hf, adapter_name=ADAPTER_NAME)
    except ValueError as e:  # no module matches the targets
        raise ValueError(f"trainer.lora.target_modules: {e}") from None
    outside = outside_decoder_layers(hf)
    if outside:
        raise ValueError(
            f"trainer.lora.target_modules: {', '.join(outside[:3])}"
            f"{f' (and {len(outside) - 3} more)' if len(outside) > 3 else ''} is not a linear"
            " module of the decoder layers; only the decoder layers' linear modules (nn.Linear)"
            " are supported (the LM head and the embedding are computed from their base"
            " weights)"
        )
    for name, p in hf.named_parameters():
        p.requires_grad_(is_adapter(name))
    return config


def adapted_modules(hf: nn.Module) -> list[str]:
    """The names of the modules that carry an adapter (PEFT's LoRA layers), in order."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [name for name, m in hf.named_modules() if isinstance(m, BaseTunerLayer)]


def outside_decoder_layers(hf: nn.Module) -> list[str]:
    """The adapted modules that are not linear modules (`nn.Linear`) under the decoder's
    layers (`core.model_parts.decoder_layers`). GPT-2's `Conv1D` is one of them: its weight
    is stored transposed, which the merge does not expect (and vLLM serves GPT-2 without
    LoRA)."""
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    from async_grpo.core.model_parts import decoder_layers

    layers = decoder_layers(hf)
    prefix = next(name for name, m in hf.named_modules() if m is layers) + "."
    return [
        name
        for name, m in hf.named_modules()
        if isinstance(m, BaseTunerLayer)
        and not (name.startswith(prefix) and isinstance(m.get_base_layer(), torch.nn.Linear))
    ]


def lora_settings(cfg: LoraConfig, hf: nn.Module) -> dict[str, Any]:
    """What makes one LoRA policy's function differ from another's on the same base: the
    rank, alpha, dropout and the adapted modules (the targets as PEFT resolved them on
    `hf`, so `[all-linear]` and the same modules named one by one are equal). A
    checkpoint records it; a resume with other settings is refused."""
    return {
        "rank": cfg.rank,
        "alpha": float(cfg.alpha),
        "dropout": float(cfg.dropout),
        "target_modules": sorted(adapted_modules(hf)),
    }


def base_model_record(model_dir: str | Path) -> str:
    """How an adapter names its base model (`base_model_name_or_path`): a prepared model's
    name (`smollm2-135m`: found again on any machine), else the folder's absolute path
    (found from any working directory)."""
    from async_grpo.models import PREPARED, cache_dir

    path = Path(model_dir).expanduser().resolve()
    for name in PREPARED:
        if path == (cache_dir() / "models" / name).expanduser().resolve():
            return name
    return str(path)


def base_model_dir(adapter: str | Path, recorded: str | None) -> Path:
    """The base model of the adapter folder `adapter`, from what its config records (a
    prepared model's name or a folder); `UserError` if it is not found."""
    from async_grpo.errors import UserError
    from async_grpo.models import resolve_model

    if not recorded:
        raise UserError(f"{adapter}: the adapter names no base model (base_model_name_or_path)")
    try:
        return resolve_model(recorded)
    except UserError as e:
        raise UserError(f"{adapter}: the adapter's base model is not found ({e})") from None


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is one of the trained factors."""
    return ".lora_A." in name or ".lora_B." in name


def is_adapter_dir(folder: str | Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def adapter_file_name(name: str) -> str:
    """PEFT's saved name of a factor: `model.layers.0.self_attn.q_proj.lora_A.default.weight`
    -> `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return _PEFT_PREFIX + name.replace(f".{ADAPTER_NAME}.", ".")


def parameter_name(file_name: str) -> str:
    """The inverse of `adapter_file_name`."""
    head, _, tail = file_name.removeprefix(_PEFT_PREFIX).rpartition(".")
    return f"{head}.{ADAPTER_NAME}.{tail}"


def merged(weight: Tensor, a: Tensor, b: Tensor, factor: float) -> Tensor:
    """`weight + factor * b @ a`, computed in fp32 (a bf16 sum would round the update away:
    bf16 keeps 8 bits, an update of 1e-4 on a weight of 1e-1 is below its last bit) and
    returned in fp32."""
    return weight.float() + factor * (b.float() @ a.float())


def write_adapter(
    folder: Path, tensors: dict[str, Tensor], config: dict[str, Any], base: str | None = None
) -> Path:
    """A PEFT adapter folder (`adapter_model.safetensors` by PEFT's saved names, and
    `adapter_config.json`), which PEFT and vLLM's LoRA loader read. Each file is written
    under a temporary name of this call's own and renamed, so a reader never finds half a
    file, and writers of the same folder at once (the tensor-parallel workers of one
    engine, each with the same adapter) never write into one another's file."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(config, base_model_name_or_path=base)
    tmp = _own_temporary(folder, ADAPTER_FILE)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, folder / ADAPTER_FILE)
    tmp = _own_temporary(folder, ADAPTER_CONFIG)
    tmp.write_text(json.dumps(cfg, indent=1, sort_keys=True))
    os.replace(tmp, folder / ADAPTER_CONFIG)
    return folder


def _own_temporary(folder: Path, name: str) -> Path:
    """A name in `folder` that no other writer is given (`name.<random>.tmp`)."""
    import uuid

    return folder / f"{name}.{uuid.uuid4().hex}.tmp"


def read_adapter_config(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / ADAPTER_CONFIG).read_text())


def read_adapter(folder: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """An adapter folder's tensors (by PEFT's saved names) and config."""
    from safetensors.torch import load_file

    folder = Path(folder)
    return load_file(str(folder / ADAPTER_FILE)), json.loads((folder / ADAPTER_CONFIG).read_text())


def merge_folder(
    adapter: dict[str, Tensor], config: dict[str, Any], base: dict[str, Tensor]
) -> dict[str, Tensor]:
    """The base model's tensors (by file name) with every adapted weight merged in, in the
    base's own dtype."""
    factor = config["lora_alpha"] / config["r"]
    out = dict(base)
    for name in adapter:
        if ".lora_A." not in name:
            continue
        module = name.removeprefix(_PEFT_PREFIX).rpartition(".lora_A.")[0]
        key = f"{module}.weight"
        b = adapter[name.replace(".lora_A.", ".lora_B.")]
        out[key] = merged(base[key], adapter[name], b, factor).to(base[key].dtype)
    return out
