"""Settings that parse but cannot run together, refused before anything starts.

In: a `RunConfig` built by `config.from_dict`. Out: nothing, or `ConfigError` with one line
naming the key, its value and what was expected (a run would hang or crash later).
`load_config` reads a YAML file and overrides into a checked `RunConfig` (here, above
config.py: the classes never import their checks).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from typing import Any

import yaml

from async_grpo.config import (
    ConfigError,
    CorrectionConfig,
    RunConfig,
    apply_override,
    from_dict,
)
from async_grpo.preflight.placement import validate_placement
from async_grpo.text import NOT_UNICODE, not_unicode, read_text


def finite_numbers(node: Any, where: str = "") -> None:
    """Every float of the config is a finite number (nan and inf pass every range check)."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            finite_numbers(getattr(node, f.name), f"{where}.{f.name}" if where else f.name)
    elif isinstance(node, dict):
        for key, value in node.items():
            finite_numbers(value, f"{where}.{key}")
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            finite_numbers(value, f"{where}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"{where}: must be a finite number, got {node}")


def check_numbers(cfg: RunConfig) -> None:
    """Each number alone: finite, and within the range its key can run with."""
    finite_numbers(cfg)
    g, b, t, v = cfg.generation, cfg.batcher, cfg.trainer, cfg.verifier
    positive = {
        "generation.num_workers": g.num_workers,
        "generation.max_concurrent_seqs": g.max_concurrent_seqs,
        "generation.max_new_tokens": g.max_new_tokens,
        "logprob.num_workers": cfg.logprob.num_workers,
        "verifier.num_workers": v.num_workers,
        "verifier.timeout_s": v.timeout_s,
        "batcher.questions_per_step": b.questions_per_step,
        "batcher.samples_per_question": b.samples_per_question,
        "batcher.max_tokens_per_gpu": b.max_tokens_per_gpu,
        "trainer.num_ranks": t.num_ranks,
        "trainer.max_steps": t.max_steps,
        "trainer.mini_batches": t.mini_batches,
        "trainer.epochs": t.epochs,
        "trainer.stop_window": t.stop_window,
        "trainer.lr": t.lr,
        "trainer.push_every": t.push_every,
        "trainer.grad_clip": t.grad_clip,
        "batcher.curriculum_floor": b.curriculum_floor,
        "generation.kv_cache_gib": g.kv_cache_gib,  # the CPU engine's cache, exactly
        "verifier.judge.kv_cache_gib": v.judge.kv_cache_gib,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value}")
    if t.mini_batches > b.questions_per_step:
        raise ConfigError(
            f"trainer.mini_batches: {t.mini_batches} parts of whole groups need at least as"
            f" many groups a step, got batcher.questions_per_step={b.questions_per_step}"
        )
    non_negative = {
        "generation.temperature": g.temperature,
        "batcher.max_off_policy_steps": b.max_off_policy_steps,
        "batcher.spare_groups": b.spare_groups,
        "batcher.dynamic_sampling": b.dynamic_sampling,
        "trainer.warmup_steps": t.warmup_steps,
        "trainer.weight_decay": t.weight_decay,
        "trainer.save_every": t.save_every,
        "trainer.loss.kl_coef": t.loss.kl_coef,
        "max_worker_restarts": cfg.max_worker_restarts,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}")
    for key, value in {
        "verifier.max_error_fraction": v.max_error_fraction,
        "batcher.max_missing_fraction": b.max_missing_fraction,
    }.items():
        if not 0 < value <= 1:
            raise ConfigError(f"{key}: must be in (0, 1], got {value}")


def validate(cfg: RunConfig) -> None:
    """Refuse configs that cannot run (they would hang or crash later)."""
    check_numbers(cfg)
    validate_generation(cfg)
    validate_batcher(cfg)
    validate_verifier(cfg)
    validate_devices(cfg)
    validate_environment(cfg)
    validate_eval(cfg)
    validate_dataset(cfg)
    validate_loss(cfg)
    validate_lora(cfg)
    validate_placement(cfg)


def validate_dataset(cfg: RunConfig) -> None:
    """Settings that only a chat template reads need prompt_format: chat; a map is a
    `module:function` name (imported when the rows are read, data/rows.py)."""
    d = cfg.dataset
    if cfg.prompt_format == "plain":
        for key, value in (
            ("system_prompt", d.system_prompt),
            ("chat_template_kwargs", d.chat_template_kwargs),
        ):
            if value:
                raise ConfigError(
                    f"dataset.{key}: set, but prompt_format: plain uses no chat template"
                    " (the prompt is the text as it is); drop it or use prompt_format: chat"
                )
    if d.map is not None and d.map.count(":") != 1:
        raise ConfigError(f"dataset.map: expected module:function, got {d.map!r}")
    for key in ("prompt_key", "answer_key"):
        if not getattr(d, key):
            raise ConfigError(f"dataset.{key}: must name a column, got an empty string")


def validate_generation(cfg: RunConfig) -> None:
    """Sampling the trainer can score, and a sample that fits the engine and a row."""
    g, b = cfg.generation, cfg.batcher
    if not 0 < g.top_p <= 1:
        raise ConfigError(f"generation.top_p: must be in (0, 1], got {g.top_p}")
    if g.top_p < 1:
        raise ConfigError(
            f"generation.top_p: {g.top_p} makes vLLM report log-probs of the top-p truncated"
            " distribution, which the trainer does not score (the importance ratios would be"
            " wrong); sample with top_p: 1.0"
        )
    if b.samples_per_question > g.max_concurrent_seqs:
        raise ConfigError(
            f"batcher.samples_per_question: {b.samples_per_question} exceeds"
            f" generation.max_concurrent_seqs={g.max_concurrent_seqs}; a group could never be served"
        )
    if g.max_new_tokens >= g.max_model_len:
        raise ConfigError(
            f"generation.max_new_tokens: {g.max_new_tokens} leaves no room for a prompt"
            f" in generation.max_model_len={g.max_model_len}"
        )
    if b.max_tokens_per_gpu < g.max_model_len:
        raise ConfigError(
            f"batcher.max_tokens_per_gpu: {b.max_tokens_per_gpu} is below generation.max_model_len="
            f"{g.max_model_len}; a full-length sample could never be packed"
        )


def validate_batcher(cfg: RunConfig) -> None:
    """Pushes within the staleness bound; spares only where groups are set aside."""
    b, t = cfg.batcher, cfg.trainer
    if b.max_off_policy_steps < t.push_every - 1:
        raise ConfigError(
            f"trainer.push_every: {t.push_every} makes samples {t.push_every - 1} steps stale,"
            f" above batcher.max_off_policy_steps={b.max_off_policy_steps}; the run would stall"
        )
    if b.spare_groups and not (
        b.skip_zero_advantage and t.loss.kl_coef == 0 and t.loss.entropy_coef == 0
    ):
        raise ConfigError(
            "batcher.spare_groups: spares replace equal-reward groups, which are set aside only"
            " with batcher.skip_zero_advantage on and trainer.loss.kl_coef and entropy_coef 0"
        )


def validate_verifier(cfg: RunConfig) -> None:
    v = cfg.verifier
    if v.combine == "weighted":
        missing = [r for r in v.rewards if r not in v.weights]
        if missing:
            raise ConfigError(f"verifier.weights: no weight for reward {missing[0]!r}")
    if not v.rewards and not v.models:
        raise ConfigError(
            "verifier.rewards: at least one reward is required (or a model reward:"
            " verifier.judge.model, verifier.reward_model.model)"
        )
    unknown = [k for k in v.weights if k not in v.rewards and k not in v.models]
    if unknown:
        raise ConfigError(
            f"verifier.weights: {unknown[0]!r} names no reward of this run"
            f" (rewards: {', '.join([*v.rewards, *v.models])})"
        )
    from async_grpo.preflight.rewards import validate_model_rewards

    validate_model_rewards(cfg)
    o, limit = v.overlong, cfg.generation.max_new_tokens
    if not (0 <= o.buffer < limit) or o.penalty < 0:
        raise ConfigError(
            f"verifier.overlong: buffer {o.buffer} must be in [0, generation.max_new_tokens"
            f" = {limit}) and penalty {o.penalty} >= 0"
        )
    if o.buffer and cfg.environment.multi_turn:
        raise ConfigError(
            "verifier.overlong: the penalty applies to single-turn completions; an"
            " environment scores its own episodes (give the length penalty there)"
        )


def validate_devices(cfg: RunConfig) -> None:
    """Attention, kernels and weight transports the trainer's device can run."""
    t, b = cfg.trainer, cfg.batcher
    if t.device == "cpu" and t.attention in ("flex", "flash"):
        raise ConfigError(
            f"trainer.attention: {t.attention!r} cannot train on CPU"
            " (flash-attn needs CUDA; PyTorch has no flex_attention backward on CPU); use auto"
        )
    if t.kernels == "liger" and t.device != "cuda":
        raise ConfigError("trainer.kernels: 'liger' runs Triton kernels on CUDA only; use eager")
    if t.kernels == "liger" and importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError(
            "trainer.kernels: 'liger' needs the liger-kernel package (pip install 'async-grpo[gpu]')"
        )
    if (t.weight_transport, t.device) in (("cuda_ipc", "cpu"), ("shm", "cuda")):
        raise ConfigError(
            f"trainer.weight_transport: {t.weight_transport!r} cannot carry weights from a"
            f" trainer on {t.device}; use auto or broadcast"
        )
    if t.device == "cpu" and cfg.logprob.attention == "flash":
        raise ConfigError("logprob.attention: 'flash' needs CUDA; use auto, sdpa or flex")
    if t.attention == "flash" and b.share_prompts:
        raise ConfigError(
            "trainer.attention: 'flash' (varlen) cannot express batcher.share_prompts;"
            " use flex or auto"
        )


def validate_loss(cfg: RunConfig) -> None:
    g = cfg.generation
    from async_grpo.core.loss import resolved

    loss = resolved(cfg.trainer.loss)
    low_max = float("inf") if loss.objective == "gmpo" else 1.0  # gmpo's are log-space
    if not (0 <= loss.clip_low < low_max) or loss.clip_high < 0:
        raise ConfigError(
            f"trainer.loss.clip_low/clip_high: bad bounds {loss.clip_low}/{loss.clip_high}"
            f" for objective {loss.objective} (expected 0 <= clip_low < {low_max:g},"
            " clip_high >= 0)"
        )
    if loss.dual_clip is not None and loss.dual_clip <= 1:
        raise ConfigError(f"trainer.loss.dual_clip: must be > 1, got {loss.dual_clip}")
    if loss.cispo_cap <= 0:
        raise ConfigError(f"trainer.loss.cispo_cap: must be > 0, got {loss.cispo_cap}")
    for name in ("sapo_tau_pos", "sapo_tau_neg"):
        if not getattr(loss, name) > 0:
            raise ConfigError(f"trainer.loss.{name}: must be > 0, got {getattr(loss, name)}")
    validate_correction(loss.correction)
    if loss.temperature != g.temperature:
        raise ConfigError(
            f"trainer.loss.temperature: {loss.temperature} differs from generation.temperature="
            f"{g.temperature}; the trainer's log-probs would not match the sampler's"
        )


def validate_correction(c: CorrectionConfig) -> None:
    """The off-policy correction's band: positive edges, floor below cap, floor for mask."""
    where = "trainer.loss.correction"
    for name in ("cap", "floor"):
        value = getattr(c, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{where}.{name}: must be > 0 or null, got {value}")
    if c.floor is not None and c.mode != "mask":
        raise ConfigError(f"{where}.floor: only a mask has a lower edge; set mode: mask")
    if c.floor is not None and c.cap is not None and c.floor >= c.cap:
        raise ConfigError(f"{where}: floor {c.floor} must be below cap {c.cap}")
    if c.mode == "mask" and c.cap is None and c.floor is None:
        raise ConfigError(f"{where}: mode mask needs a cap, a floor or both")
    if c.negative_threshold is not None and c.negative_threshold < 0:
        raise ConfigError(
            f"{where}.negative_threshold: must be >= 0 or null, got {c.negative_threshold}"
        )


def validate_environment(cfg: RunConfig) -> None:
    """An environment run: the names resolve, a group fits a worker, an episode fits the
    context."""
    e, g, b = cfg.environment, cfg.generation, cfg.batcher
    if e.harness:
        validate_harness(cfg)
        return
    if e.rollout is not None:
        raise ConfigError("environment.rollout: set environment.kind: openai too (a harness)")
    if e.name is None:
        if e.url:
            raise ConfigError("environment.url: set environment.name too (what the server runs)")
        return
    from async_grpo.environments import get_environment

    declared = get_environment(e.name)  # an unknown name is refused here, not in a worker
    for key in ("num_workers", "capacity", "max_observation_tokens", "step_timeout_s"):
        if getattr(e, key) <= 0:
            raise ConfigError(f"environment.{key}: must be > 0, got {getattr(e, key)}")
    if b.samples_per_question > e.capacity:
        raise ConfigError(
            f"batcher.samples_per_question: {b.samples_per_question} exceeds"
            f" environment.capacity={e.capacity}; a group's episodes could never be acquired"
        )
    turns = e.max_turns or declared.max_turns
    budget = e.max_episode_tokens or declared.max_episode_tokens
    if turns < 1 or budget < 1:
        raise ConfigError(
            f"environment.max_turns/max_episode_tokens: must be >= 1, got {turns}/{budget}"
        )
    if budget >= g.max_model_len:
        raise ConfigError(
            f"environment.max_episode_tokens: {budget} leaves no room for a prompt in"
            f" generation.max_model_len={g.max_model_len}"
        )


def validate_harness(cfg: RunConfig) -> None:
    """An agent-harness run (or a verifiers environment's): the rollout function imports
    (the environment loads), the tool parser is vLLM's, and nothing of the environment
    pool is asked for."""
    e, b = cfg.environment, cfg.batcher
    if e.url is not None or (e.kind == "openai" and e.name is not None):
        raise ConfigError(
            f"environment.name/url: a harness (environment.kind: {e.kind}) drives its own"
            " conversation; leave them out"
        )
    if e.kind == "verifiers" and e.rollout is not None:
        raise ConfigError(
            "environment.rollout: a verifiers environment runs its own rollouts; leave it"
            " out (or use environment.kind: openai)"
        )
    for key in ("rollout_timeout_s", "max_rollouts"):
        if getattr(e, key) <= 0:
            raise ConfigError(f"environment.{key}: must be > 0, got {getattr(e, key)}")
    if b.samples_per_question > e.max_rollouts:
        raise ConfigError(
            f"batcher.samples_per_question: {b.samples_per_question} exceeds"
            f" environment.max_rollouts={e.max_rollouts}"
        )
    if b.share_prompts:
        raise ConfigError(
            "batcher.share_prompts: a harness's rollouts render their own prompts (they need"
            f" not share one); leave it off with environment.kind: {e.kind}"
        )
    if e.kind == "verifiers":  # loaded by preflight: once before Ray, not in every rank
        if not e.name:
            raise ConfigError("environment.name: kind verifiers needs an installed environment")
    else:
        from async_grpo.environments.harness import load_rollout

        load_rollout(e.rollout)
    if e.tool_parser is not None:
        from async_grpo.environments.endpoint import tool_parser_names

        known = sorted(tool_parser_names())
        if e.tool_parser not in known:
            raise ConfigError(
                f"environment.tool_parser: {e.tool_parser!r} is not one of vLLM's"
                f" ({', '.join(known)})"
            )


def validate_eval(cfg: RunConfig) -> None:
    """Evaluation settings that could not run, and hooks without a class."""
    e = cfg.eval
    for i, h in enumerate(cfg.hooks):
        if ":" not in h.path:
            raise ConfigError(f"hooks[{i}].path: expected module:Class, got {h.path!r}")
    if cfg.sample_every < 0 or cfg.samples_logged < 0:
        raise ConfigError("sample_every/samples_logged: must be >= 0")
    if e.data is None:
        return
    for key in ("every", "samples_per_question", "max_concurrent_seqs", "timeout_s"):
        if getattr(e, key) <= 0:
            raise ConfigError(f"eval.{key}: must be > 0, got {getattr(e, key)}")
    if e.max_questions is not None and e.max_questions <= 0:
        raise ConfigError(f"eval.max_questions: must be > 0, got {e.max_questions}")
    if e.every % cfg.trainer.push_every:
        raise ConfigError(
            f"eval.every: {e.every} is not a multiple of trainer.push_every="
            f"{cfg.trainer.push_every}; only pushed versions reach the generation pool"
        )
    if e.samples_per_question > cfg.generation.max_concurrent_seqs:
        raise ConfigError(
            f"eval.samples_per_question: {e.samples_per_question} exceeds"
            f" generation.max_concurrent_seqs={cfg.generation.max_concurrent_seqs}"
        )
    bad = [k for k in e.pass_k if not 1 <= k <= e.samples_per_question]
    if bad or not e.pass_k:
        raise ConfigError(
            f"eval.pass_k: each k must be in 1..eval.samples_per_question="
            f"{e.samples_per_question}, got {e.pass_k}"
        )
    if e.temperature < 0:
        raise ConfigError(f"eval.temperature: must be >= 0, got {e.temperature}")
    if e.temperature == 0 and e.samples_per_question > 1:
        raise ConfigError(
            f"eval.samples_per_question: {e.samples_per_question} greedy samples are all the"
            " same; use eval.temperature > 0 for pass@k"
        )
    n = e.max_new_tokens
    if n is not None and not 0 < n < cfg.generation.max_model_len:
        raise ConfigError(
            f"eval.max_new_tokens: must be in 1..{cfg.generation.max_model_len - 1}, got {n}"
        )
    models = cfg.verifier.models if e.models is None else e.models
    if e.rewards is not None and not e.rewards and not models:
        raise ConfigError("eval.rewards: name at least one reward, or leave it out")
    if cfg.environment.multi_turn:
        raise ConfigError(
            "eval.data: held-out evaluation scores single-turn completions with the verifier"
            " pool; it does not run environment episodes yet"
        )


def validate_lora(cfg: RunConfig) -> None:
    """Adapters of a size vLLM can serve, on a trainer that can hold them."""
    lora = cfg.trainer.lora
    if lora.rank == 0:
        return
    if lora.rank < 0 or lora.rank > MAX_LORA_RANK:
        raise ConfigError(
            f"trainer.lora.rank: must be in 1..{MAX_LORA_RANK} (0: off), got {lora.rank}"
        )
    if lora.alpha <= 0:
        raise ConfigError(f"trainer.lora.alpha: must be > 0, got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"trainer.lora.dropout: must be in [0, 1), got {lora.dropout}")
    if not lora.target_modules or not all(m for m in lora.target_modules):
        raise ConfigError(
            f"trainer.lora.target_modules: expected module names or [all-linear], got"
            f" {lora.target_modules!r}"
        )
    if cfg.trainer.kernels == "liger":
        raise ConfigError(
            "trainer.lora: liger-kernel's fused layers take no adapters; use kernels: eager"
        )


MAX_LORA_RANK = 512  # the largest rank vLLM serves (its max_lora_rank choices)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML config, apply `a.b.c=value` overrides, build and validate the tree."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            raw = yaml.safe_load(read_text(path)) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({e})") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        bad = not_unicode(raw)
        if bad is not None:
            raise ConfigError(f"{path}: {bad}: {NOT_UNICODE}")
    for item in overrides:
        apply_override(raw, item)
    if "tensorboard" in raw:  # moved into the trackers section
        raise ConfigError("tensorboard: moved; use trackers.tensorboard (see docs/metrics.md)")
    cfg = from_dict(RunConfig, raw, "")
    validate(cfg)
    return cfg
