"""What a run refuses in its rewards before it starts, one line each: a rule reward that does
not import; model rewards' settings (`verifier.judge`, `verifier.reward_model`;
`preflight.settings.validate` calls `validate_model_rewards`) and folders."""

from __future__ import annotations

import re

from async_grpo.config import ConfigError, RunConfig
from async_grpo.errors import UserError
from async_grpo.preflight.model import vllm_architectures


def validate_model_rewards(cfg: RunConfig) -> None:
    """The judge's template, verdict settings and limits; the reward model's limits; the
    model rewards an evaluation names."""
    v = cfg.verifier
    missing = [m for m in (cfg.eval.models or []) if m not in v.models]
    if missing:
        raise ConfigError(
            f"eval.models: {missing[0]!r} is not a model reward of this run"
            f" (verifier.judge.model / verifier.reward_model.model; this run's: {v.models})"
        )
    for name in v.models:
        sub = getattr(v, name)
        for key in ("num_workers", "timeout_s", "threads"):
            if getattr(sub, key) <= 0:
                raise ConfigError(f"verifier.{name}.{key}: must be > 0, got {getattr(sub, key)}")
        if cfg.environment.multi_turn:
            raise ConfigError(
                f"verifier.{name}: model rewards score single-turn completions; an environment"
                " scores its own episodes"
            )
    j = v.judge
    if not j.model:
        return
    from async_grpo.rewards.judge import judge_template

    template = judge_template(j)
    if "{completion}" not in template:
        raise ConfigError(
            "verifier.judge.template: has no {completion} field (its fields: {question},"
            " {answer}, {completion})"
        )
    if j.max_concurrent_seqs < 1 or j.max_tokens < 1:
        raise ConfigError("verifier.judge.max_concurrent_seqs/max_tokens: must be >= 1")
    if j.verdict == "yes_prob" and not (j.yes and j.no):
        raise ConfigError("verifier.judge.yes/no: need at least one word each")
    if j.verdict == "pattern":
        try:
            groups = re.compile(j.pattern).groups
        except re.error as e:
            raise ConfigError(
                f"verifier.judge.pattern: {j.pattern!r} is not a regex ({e})"
            ) from None
        if groups < 1:
            raise ConfigError(
                f"verifier.judge.pattern: {j.pattern!r} has no group; group 1 is the score"
            )
        r = j.score_range
        if len(r) != 2 or not r[0] < r[1]:
            raise ConfigError(f"verifier.judge.score_range: expected [low, high], got {r}")


def check_rule_rewards(cfg: RunConfig, names: list[str] | None = None) -> None:
    """Every rule reward named (default: `verifier.rewards`) is registered or imports
    (`module:function`), as the verifier workers will import it."""
    from async_grpo.rewards.registry import get_reward

    for name in cfg.verifier.rewards if names is None else names:
        get_reward(name)


def check_eval_rewards(cfg: RunConfig) -> None:
    """`async-grpo eval` starts no model pool: it scores with rule rewards alone, and needs
    one."""
    v, e = cfg.verifier, cfg.eval
    if (v.models if e.models is None else e.models) and v.models:
        raise ConfigError(
            f"verifier.{v.models[0]}: `async-grpo eval` scores with rule rewards alone; set"
            " eval.models=[] (and --rewards), or evaluate inside a run (eval.data)"
        )
    if not e.rewards and not v.rewards:
        raise ConfigError("verifier.rewards: `async-grpo eval` needs a rule reward (--rewards)")


def check_model_rewards(cfg: RunConfig) -> None:
    """Each model reward's folder (`check_model_reward`)."""
    for name in cfg.verifier.models:
        check_model_reward(cfg, name)


def check_model_reward(cfg: RunConfig, name: str) -> None:
    """The judge's model is one vLLM serves, with a tokenizer; the reward model's folder
    holds a one-label sequence classifier (rewards/reward_model.py)."""
    from transformers import AutoConfig

    from async_grpo.models import resolve_model

    key = f"verifier.{name}.model"
    try:
        folder = resolve_model(getattr(cfg.verifier, name).model)
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
            f"{key}: vLLM serves none of {folder}'s architectures {archs}; the judge runs on vLLM"
        )
    if name == "reward_model":
        from async_grpo.rewards.reward_model import is_classifier

        why = is_classifier(config)
        if why is not None:
            raise ConfigError(f"{key}: {folder} is not a reward model: {why}")
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"{key}: {folder} has no tokenizer (tokenizer.json)")
