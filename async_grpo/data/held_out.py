"""The held-out prompts (`eval.data`), refused where they overlap the training prompts."""

from __future__ import annotations

from typing import Any

from async_grpo.config import ConfigError, RunConfig


def held_out_prompts(cfg: RunConfig, model_dir: str) -> Any:
    """The eval prompts (the first `max_questions`), refused when any is also a training
    prompt (the same text, spaces at its ends aside, or the same given token ids): a
    held-out score must be held out. Both are tables (data/table.py), compared by column."""
    import pyarrow.compute as pc

    from async_grpo.data.tokenize import prepare_prompts

    e, n = cfg.eval, cfg.generation.max_model_len
    prompts = prepare_prompts(e.data, model_dir, n, cfg.prompt_format, cfg.eval_dataset)
    prompts = prompts[: e.max_questions] if e.max_questions else prompts
    train = prepare_prompts(cfg.data, model_dir, n, cfg.prompt_format, cfg.dataset)
    seen = pc.utf8_trim_whitespace(train.texts()).unique()
    flags = pc.is_in(pc.utf8_trim_whitespace(prompts.texts()), value_set=seen)
    flags = pc.fill_null(flags, False).to_pylist()
    if train.gives_ids() and prompts.gives_ids():  # token ids given, maybe no text rendered
        given = train.column("input_token_ids").to_pylist()
        ids = {tuple(t) for t in given if t is not None}
        flags = [f or tuple(p.input_token_ids) in ids for f, p in zip(flags, prompts, strict=True)]
    if any(flags):
        first = prompts[flags.index(True)].line
        raise ConfigError(
            f"eval.data: {sum(flags)} of its {len(prompts)} prompts are also training prompts"
            f" in {cfg.data} (first: row {first}); a held-out set must not overlap"
        )
    return prompts
