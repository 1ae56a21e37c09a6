"""A single-turn group: `n` completions of one prompt, scored by the verifier pool."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from async_grpo.batcher.types import ScoredSample
from async_grpo.config import RunConfig
from async_grpo.data import Prompt
from async_grpo.inference.types import SamplingSettings


async def single_turn_group(
    cfg: RunConfig,
    clients: dict[str, Any],
    books: dict[str, float],
    score_book: list[Any],
    prompt: Prompt,
    sampling: SamplingSettings,
    step: int,
    reissued: Any,
    spans: list[dict] | None = None,
    counters: dict[str, float] | None = None,
) -> list[ScoredSample] | None:
    """The scored group (advantages left 0.0 for the caller), or None when it came back
    staler than the bound. `books` gets the step's sample counts; `score_book` is the step's
    [failed, scored, first reasons] of the verifier; `spans` gets the scoring's timeline
    span; `counters` the model rewards' outcomes over the run (batcher/model_scores.py).
    Rule rewards (the verifier pool) and model rewards (the judge and reward-model pools)
    are asked for at once."""
    from async_grpo.batcher.model_scores import with_model_rewards
    from async_grpo.rewards import RewardInput

    n, ids = cfg.batcher.samples_per_question, prompt.input_token_ids
    k = cfg.batcher.max_off_policy_steps
    completions = await clients["generation"].call(
        n, "generate", ids, n, sampling, on_retry=reissued, min_version=step - k
    )
    books["samples/generated"] += len(completions)
    if step - min(c.policy_version for c in completions) > k:
        books["dropped/stale"] += n
        return None
    t0 = time.time()
    texts = [c.text for c in completions]

    async def by_rules() -> list[Any]:
        if not cfg.verifier.rewards:  # model rewards alone
            return [None] * n
        return await clients["verifier"].call(
            n,
            "score",
            [RewardInput(prompt.input, t, prompt.answer, prompt.metadata) for t in texts],
            on_retry=reissued,
        )

    counters = counters if counters is not None else defaultdict(float)
    v = cfg.verifier
    scored = await with_model_rewards(
        v, v.models, clients, counters, prompt, texts, by_rules(), reissued
    )
    if spans is not None:
        spans.append({"lane": "verifier", "what": "score", "start": t0, "end": time.time()})
    books["samples/scored"] += len(scored)
    score_book[1] += len(scored)
    for s in scored:
        if s.reason.startswith(("error", "timeout")):
            score_book[0] += 1
            if len(score_book[2]) < 3:
                score_book[2].append(s.reason)
    return [
        ScoredSample(
            ids,
            c.token_ids,
            c.logprobs,
            s.reward,
            s.components,
            0.0,
            c.policy_version,
            c.finish_reason == "length",
            reason=s.reason,
            token_versions=c.token_versions,
        )
        for c, s in zip(completions, scored, strict=True)
    ]
