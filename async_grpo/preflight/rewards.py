"""The settings of the model rewards (`verifier.judge`, `verifier.reward_model`) a run
refuses before it starts, one line each (`preflight.settings.validate` calls them)."""

from __future__ import annotations

import re

from async_grpo.config import ConfigError, RunConfig


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
