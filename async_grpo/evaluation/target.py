"""What `async-grpo eval` evaluates: a model folder, a checkpoint (its hf/ or adapter/), a
prepared model's name, or a LoRA adapter on the base model its config names."""

from __future__ import annotations

from pathlib import Path

from async_grpo.errors import UserError


def eval_adapter(name: str) -> Path | None:
    """The LoRA adapter to evaluate: a LoRA checkpoint's adapter/, or an adapter folder (an
    absolute path: the worker that loads it runs in a folder of its own)."""
    from async_grpo.adapters import is_adapter_dir

    path = Path(name)
    for folder in (path / "adapter", path):
        if is_adapter_dir(folder):
            return folder.resolve()
    return None


def eval_model_dir(name: str) -> Path:
    """A checkpoint folder (its hf/), a Hugging Face folder, or a prepared model's name, as
    an absolute path; for an adapter, the base model its config names (a prepared model's
    name or an absolute path, so a checkpoint evaluates from any folder, and copied
    elsewhere)."""
    from async_grpo.models import resolve_model

    path = Path(name)
    adapter = eval_adapter(name)
    if adapter is not None:
        from async_grpo.adapters import base_model_dir, read_adapter_config

        return base_model_dir(adapter, read_adapter_config(adapter).get("base_model_name_or_path"))
    if (path / "hf" / "config.json").is_file():
        return (path / "hf").resolve()
    if (path / "config.json").is_file():
        return path.resolve()
    if path.exists():
        raise UserError(f"{name}: neither a model folder (config.json) nor a checkpoint (hf/)")
    return resolve_model(name)
