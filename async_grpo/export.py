"""`async-grpo export`: a LoRA checkpoint merged into its base model, as a Hugging Face
folder that transformers and vLLM load like any other model.

In: a checkpoint of a LoRA run (`step_N/`, or its `adapter/` folder); the base model is the
one the adapter's config names (`base_model_name_or_path`, written by the trainer: a
prepared model's name or an absolute path) unless `--base` gives another. Out: OUT/ with
`model.safetensors` (every adapted weight `W + (alpha / r) * B @ A`, summed in fp32, stored
in `--dtype`) and the base's config and tokenizer files. OUT is written under a temporary
name and renamed: it is whole or absent.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from async_grpo.adapters import base_model_dir, is_adapter_dir, merge_folder, read_adapter
from async_grpo.errors import UserError


def add_export_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export", help="merge a LoRA checkpoint into its base model (a HF folder for vLLM)"
    )
    p.add_argument("checkpoint", help="a LoRA run's checkpoint (step_N) or its adapter/ folder")
    p.add_argument("out", help="the merged model's folder (must not exist)")
    p.add_argument("--base", help="the base model's folder (default: the adapter's own)")
    p.add_argument(
        "--dtype",
        choices=["base", "float32", "bfloat16", "float16"],
        default="base",
        help="how the merged weights are stored (default: the base's dtype)",
    )
    p.set_defaults(func=lambda args: _export(args))


def _export(args: argparse.Namespace) -> int:
    out = export_merged(Path(args.checkpoint), Path(args.out), args.base, args.dtype)
    print(f"merged model written to {out}")
    return 0


def export_merged(source: Path, out: Path, base: str | None = None, dtype: str = "base") -> Path:
    """Merge the adapter of `source` into its base; returns `out`."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = source / "adapter" if (source / "adapter").is_dir() else source
    if not is_adapter_dir(folder):
        raise UserError(
            f"export: {source} holds no adapter (expected a LoRA run's step_N or its"
            " adapter/ folder, with adapter_config.json)"
        )
    if out.exists():
        raise UserError(f"export: {out} exists; name a new folder")
    adapter, config = read_adapter(folder)
    if base:
        base_dir = Path(base)
        if not (base_dir / "config.json").is_file():
            raise UserError(f"export: base model {base} not found (no config.json)")
    else:
        try:
            base_dir = base_model_dir(folder, config.get("base_model_name_or_path"))
        except UserError as e:
            raise UserError(f"export: {e}; give it with --base") from None
    weights: dict[str, Any] = {}
    for f in sorted(base_dir.glob("*.safetensors")):
        weights |= load_file(str(f))
    try:
        merged = merge_folder(adapter, config, weights)
    except KeyError as e:
        raise UserError(f"export: the adapter adapts {e}, which {base_dir} does not hold") from None
    if dtype != "base":
        merged = {k: v.to(getattr(torch, dtype)) for k, v in merged.items()}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    from async_grpo.models import _DONE_MARKER  # a prepared model's own record, not ours

    for f in base_dir.iterdir():  # config, tokenizer, generation config
        weights = f.name.endswith((".safetensors", ".safetensors.index.json"))
        if f.is_file() and not weights and f.name != _DONE_MARKER:
            shutil.copy2(f, tmp / f.name)
    save_file({k: v.contiguous() for k, v in merged.items()}, str(tmp / "model.safetensors"))
    tmp.rename(out)
    return out
