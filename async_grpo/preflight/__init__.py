"""What a run checks before Ray starts, beyond the config's own settings (preflight.settings):
the output folder and the checkpoint to resume, the reward functions, the model folder,
the LoRA targets and a resumed checkpoint's LoRA settings.

In: the run config, the resolved model folder, `--resume`. Out: nothing, or `UserError`
(one line; the command exits with code 2). Cheapest first: a bad input ends in seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from async_grpo.config import ConfigError, RunConfig
from async_grpo.errors import UserError


def preflight(cfg: RunConfig, model_dir: str | Path, resume: str | None) -> None:
    from async_grpo.trainer.checkpoint import find_resume, refuse_reuse

    refuse_reuse(cfg.output_dir, resume)
    resumed = find_resume(cfg.output_dir, resume) if resume else None
    if cfg.environment.kind == "verifiers":  # the environment loads, as the batcher will
        from async_grpo.environments.verifiers_env import load_env

        load_env(cfg.environment.name, cfg.environment.args)
    elif cfg.environment.harness:  # the harness was imported by the config's checks
        pass
    elif cfg.environment.name is None:  # single-turn: the verifiers will import these
        from async_grpo.rewards.registry import get_reward

        for name in cfg.verifier.rewards:
            get_reward(name)
        check_model_rewards(cfg)
    else:
        check_turn_template(cfg, Path(model_dir))
    check_model(Path(model_dir), run_attentions(cfg))
    lora = check_lora_targets(cfg, Path(model_dir)) if cfg.trainer.lora.rank else None
    if resumed is not None:
        check_resumed_lora(resumed, lora)


def check_model_rewards(cfg: RunConfig) -> None:
    """The judge's model is one vLLM serves, with a tokenizer; the reward model's folder
    holds a one-label sequence classifier (rewards/reward_model.py)."""
    from transformers import AutoConfig

    from async_grpo.models import resolve_model

    v = cfg.verifier
    for name in v.models:
        key = f"verifier.{name}.model"
        try:
            folder = resolve_model(getattr(v, name).model)
        except UserError as e:
            raise ConfigError(f"{key}: {e}") from None
        try:
            config = AutoConfig.from_pretrained(folder)
        except (OSError, ValueError, KeyError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"{key}: transformers cannot read {folder} ({first})") from None
        archs = list(getattr(config, "architectures", None) or [])
        if name == "judge" and not any(a in vllm_architectures() for a in archs):
            raise ConfigError(
                f"{key}: vLLM serves none of {folder}'s architectures {archs}; the judge"
                " runs on vLLM"
            )
        if name == "reward_model":
            from async_grpo.rewards.reward_model import is_classifier

            why = is_classifier(config)
            if why is not None:
                raise ConfigError(f"{key}: {folder} is not a reward model: {why}")
        if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            raise ConfigError(f"{key}: {folder} has no tokenizer (tokenizer.json)")


def check_turn_template(cfg: RunConfig, model_dir: Path) -> None:
    """An episode writes the environment's replies as user turns of the model's chat
    template (environments/turns.py), whatever `prompt_format` says of the first prompt:
    a model without one cannot run an environment."""
    from transformers import AutoTokenizer

    if not AutoTokenizer.from_pretrained(model_dir).chat_template:
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


def run_attentions(cfg: RunConfig) -> list[Any]:
    """The attention backends the run's trainer and log-prob workers may use: dense SDPA on
    CPU, and flex_attention where asked or on CUDA (`core.attention.select_attention`)."""
    from async_grpo.core.attention import DenseAttention
    from async_grpo.core.attention.flex import FlexAttention

    asked = {cfg.trainer.attention, cfg.logprob.attention}
    flex = "flex" in asked or (cfg.trainer.device == "cuda" and "auto" in asked)
    return [DenseAttention(), FlexAttention(max_tokens=256)] if flex else [DenseAttention()]


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


def environment_data(cfg: RunConfig, resumed: bool = False) -> None:
    """`data: environment`: the verifiers environment's own dataset, written to a file
    the run then reads as any other (environments/verifiers_env.py). A resumed run reads
    the file its start wrote: the prompts its sampler's position counts in."""
    from async_grpo.environments.verifiers_env import ENV_DATA, data_file

    if cfg.data == ENV_DATA:
        from async_grpo.environments.verifiers_env import environment_data as write

        kept = data_file(cfg)
        cfg.data = kept if resumed and Path(kept).is_file() else write(cfg)


def checked_before_ray(cfg: RunConfig, resume: str | None, address: str | None = None) -> str:
    """Everything a run can refuse before Ray, the pools or torchrun start (preflight, the
    prompts, a held-out set that overlaps training); the model's folder. `run` and `train`
    call it alike; `address`: the cluster a run joins (its pools may be on other nodes)."""
    from async_grpo.data.tokenize import prepare_prompts
    from async_grpo.models import resolve_model
    from async_grpo.preflight import preflight

    if address is None and cfg.ray_address is None:  # all on this node: pools share no core
        from async_grpo.placement import check_disjoint
        from async_grpo.preflight.settings import validate_placement

        check_disjoint(validate_placement(cfg))
    model_dir = str(resolve_model(cfg.model))
    preflight(cfg, model_dir, resume)
    environment_data(cfg, resumed=resume is not None)
    prepare_prompts(
        cfg.data, Path(model_dir), cfg.generation.max_model_len, cfg.prompt_format, cfg.dataset
    )
    if cfg.eval.data:
        from async_grpo.data.held_out import held_out_prompts

        held_out_prompts(cfg, model_dir)
    return model_dir
