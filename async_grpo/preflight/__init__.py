"""What a run refuses before it starts, in one room: each check a small function named for
what it refuses, called from one place, `checked_before_ray`, before Ray, the pools or
torchrun start. A refusal is one line (`ConfigError` / `UserError`, exit code 2), cheapest
checks first, so a bad input ends in seconds.

- settings.py: settings that parse but cannot run together (`load_config`, `validate`);
- placement.py: core lists that do not parse, do not exist here or overlap;
- model.py: a model folder transformers cannot read or vLLM does not serve, LoRA targets
  it lacks, a resumed checkpoint trained with other LoRA settings;
- family.py: a family the trainer does not compute as transformers does;
- rewards.py: rule rewards that do not import, model rewards' settings and folders;
- here: an output folder a finished run holds, a checkpoint to resume that is missing, an
  environment that does not load; then the data's rows (data/screen.py) and a held-out set
  that overlaps training (data/held_out.py).
"""

from __future__ import annotations

from pathlib import Path

from async_grpo.config import ConfigError, RunConfig
from async_grpo.preflight.model import (
    check_lora_targets,
    check_model,
    check_resumed_lora,
    check_turn_template,
    run_attentions,
)
from async_grpo.preflight.rewards import (
    check_eval_rewards,
    check_model_reward,
    check_model_rewards,
    check_rule_rewards,
)


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
        check_rule_rewards(cfg)
        check_model_rewards(cfg)
    else:
        check_turn_template(cfg, Path(model_dir))
    check_model(Path(model_dir), run_attentions(cfg))
    lora = check_lora_targets(cfg, Path(model_dir)) if cfg.trainer.lora.rank else None
    if resumed is not None:
        check_resumed_lora(resumed, lora)


def environment_data(cfg: RunConfig, resumed: bool = False) -> None:
    """`data: environment`: the verifiers environment's own dataset, written to a file
    the run then reads as any other (environments/verifiers_env.py). A resumed run reads
    the file its start wrote: the prompts its sampler's position counts in."""
    from async_grpo.environments.verifiers_env import ENV_DATA, data_file

    if cfg.data == ENV_DATA:
        from async_grpo.environments.verifiers_env import environment_data as write

        kept = data_file(cfg)
        cfg.data = kept if resumed and Path(kept).is_file() else write(cfg)


def checked_before_ray(
    cfg: RunConfig,
    command: str = "run",
    *,
    resume: str | None = None,
    address: str | None = None,
    model: str | None = None,
    mode: str | None = None,
) -> str | None:
    """Everything `command` can refuse before Ray, the pools or torchrun start; the model
    folder it runs (None for a worker pool without one). Every command calls it the same
    way, after `load_config`: `run` and `train` (each rank, by hand; `resume`, and
    `address`, the cluster a run joins: its pools may be on other nodes), `eval` (`model`:
    what it evaluates) and `worker` (`mode`: its pool; `model`: the pool's model)."""
    if command in ("run", "train"):
        return _run(cfg, resume, address)
    if command == "eval":
        return _eval(cfg, model)
    if command == "worker":
        return _worker(cfg, mode, model)
    raise ValueError(f"checked_before_ray: no command {command!r}")


def _run(cfg: RunConfig, resume: str | None, address: str | None) -> str:
    from async_grpo.data.tokenize import prepare_prompts
    from async_grpo.models import resolve_model

    if address is None and cfg.ray_address is None:  # all on this node: pools share no core
        from async_grpo.preflight.placement import check_disjoint, validate_placement

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


def _eval(cfg: RunConfig, model: str | None) -> str:
    """`async-grpo eval`: rule rewards it can score with, the model (a folder, a checkpoint
    or an adapter's base), and its prompts."""
    from async_grpo.data.tokenize import prepare_prompts
    from async_grpo.evaluation.target import eval_model_dir

    check_eval_rewards(cfg)
    check_rule_rewards(cfg, cfg.eval.rewards or cfg.verifier.rewards)
    model_dir = eval_model_dir(model or cfg.model)
    check_model(model_dir)
    e = cfg.eval
    prepare_prompts(
        e.data, model_dir, cfg.generation.max_model_len, cfg.prompt_format, cfg.eval_dataset
    )
    return str(model_dir)


def _worker(cfg: RunConfig, mode: str | None, model: str | None) -> str | None:
    """`async-grpo worker --mode MODE`: what its pool needs, checked on this machine before
    it joins the cluster (its cores were checked with the settings)."""
    from async_grpo.models import resolve_model

    if mode == "verifier":
        check_rule_rewards(cfg)
        return None
    if mode == "environment":
        if cfg.environment.name is None:
            raise ConfigError("environment.name: required for --mode environment (e.g. calculator)")
        if cfg.environment.kind == "verifiers":
            from async_grpo.environments.verifiers_env import load_env

            load_env(cfg.environment.name, cfg.environment.args)
        return None
    if mode in ("judge", "reward_model"):
        section = getattr(cfg.verifier, mode)
        section.model = model or section.model
        if section.model is None:
            raise ConfigError(f"verifier.{mode}.model: required for --mode {mode}")
        check_model_reward(cfg, mode)
        return str(resolve_model(section.model))
    model_dir = resolve_model(model or cfg.model)
    check_model(model_dir, run_attentions(cfg) if mode == "logprob" else None)
    return str(model_dir)
