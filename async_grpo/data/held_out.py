"""The held-out prompts (`eval.data`), refused where they overlap the training prompts."""

from __future__ import annotations

from typing import Any

from async_grpo.config import ConfigError, RunConfig


def held_out_prompts(cfg: RunConfig, model_dir: str) -> Any:
    """The eval prompts (tokenized, the first `max_questions`), refused when any is also a
    training prompt (same text or same rendered prompt): a held-out score must be held
    out. Both sets are prepared tables (data/table.py), compared column against column."""
    import pyarrow.compute as pc

    from async_grpo.data.tokenize import prepare_prompts

    e, n = cfg.eval, cfg.generation.max_model_len
    prompts = prepare_prompts(e.data, model_dir, n, cfg.prompt_format, cfg.eval_dataset)
    prompts = prompts[: e.max_questions] if e.max_questions else prompts
    train = prepare_prompts(cfg.data, model_dir, n, cfg.prompt_format, cfg.dataset)
    shared = pc.is_in(prompts.column("input"), value_set=train.column("input").combine_chunks())
    rendered = prompts.column("rendered")
    also = pc.is_in(rendered, value_set=train.column("rendered").combine_chunks())
    flags = pc.or_(shared, pc.and_(pc.not_equal(rendered, ""), also)).to_pylist()
    if _given_ids(train) and _given_ids(prompts):  # token ids given, no text rendered
        ids = {tuple(p.input_token_ids) for p in train}
        flags = [f or tuple(p.input_token_ids) in ids for f, p in zip(flags, prompts, strict=True)]
    if any(flags):
        first = prompts.column("row")[flags.index(True)].as_py()
        raise ConfigError(
            f"eval.data: {sum(flags)} of its {len(prompts)} prompts are also training prompts"
            f" in {cfg.data} (first: row {first}); a held-out set must not overlap"
        )
    return prompts


def _given_ids(table: Any) -> bool:
    """Whether any prompt of `table` came with its own token ids (no rendered text)."""
    import pyarrow.compute as pc

    return bool(pc.any(pc.equal(table.column("rendered"), "")).as_py())
