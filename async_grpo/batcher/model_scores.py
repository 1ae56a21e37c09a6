"""A group's model rewards: the judge pool's verdicts and the reward-model pool's scores,
asked for together with the rule rewards as soon as the group's completions are in.

In: the run config, the pool clients, the prompt, the completions' text. Out: per model
reward (`judge`, `reward_model`), one score per completion. Never raises and never waits
past the reward's `timeout_s`: a call that times out, fails (a dead pool, a dead worker
past its retries) or answers None for a sample gives that sample the configured
`fallback`, counted in `counters` under `NAME/timeout`, `NAME/error` or `NAME/unparsed`
(`NAME/scored` counts every sample asked), over the run.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from async_grpo.config import RunConfig, VerifierConfig
from async_grpo.data import Prompt
from async_grpo.deadline import within

OUTCOMES = ("scored", "timeout", "error", "unparsed")
CALLS = {"judge": "judge", "reward_model": "score"}  # pool -> the worker's method


def scoring_pools(cfg: RunConfig) -> list[str]:
    """The pools that score a run's samples: none for a harness (it scores its rollouts),
    the environment pool for episodes, else the verifiers (with rule rewards) and the
    model rewards' pools."""
    e = cfg.environment
    if e.multi_turn:
        return [] if e.harness else ["environment"]
    return (["verifier"] if cfg.verifier.rewards else []) + cfg.verifier.models


def model_counter_keys(cfg: RunConfig) -> list[str]:
    """The counters a run with these model rewards reports (0 until something happens)."""
    return [f"{name}/{o}" for name in cfg.verifier.models for o in OUTCOMES]


def call_items(name: str, prompt: Prompt, texts: list[str]) -> list[tuple[Any, ...]]:
    """What the `name` pool's workers take for each completion."""
    if name == "judge":
        return [(prompt.input, prompt.answer, t) for t in texts]
    return [(prompt.input, t) for t in texts]


async def model_scores(
    v: VerifierConfig,
    names: list[str],
    clients: dict[str, Any],
    counters: dict[str, float],
    prompt: Prompt,
    texts: list[str],
    on_retry: Any = None,
) -> dict[str, list[float]]:
    """The scores of `texts` by each model reward of `names` (of `v`), asked of the pools
    at once ({} for no names)."""
    results = await asyncio.gather(
        *(_scores(v, name, clients[name], counters, prompt, texts, on_retry) for name in names)
    )
    return dict(zip(names, results, strict=True))


async def _scores(
    v: VerifierConfig,
    name: str,
    client: Any,
    counters: dict[str, float],
    prompt: Prompt,
    texts: list[str],
    on_retry: Any,
) -> list[float]:
    sub = getattr(v, name)
    n = len(texts)
    counters[f"{name}/scored"] += n
    try:
        call = client.call(n, CALLS[name], call_items(name, prompt, texts), on_retry=on_retry)
        answers = await within(call, sub.timeout_s)  # the bound holds (deadline.py)
    except TimeoutError:
        counters[f"{name}/timeout"] += n
        return [sub.fallback] * n
    except Exception as e:  # a pool that cannot answer: the run goes on with the fallback
        counters[f"{name}/error"] += n
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        print(f"batcher: {name}: {n} samples get the fallback {sub.fallback:g}: {first}")
        return [sub.fallback] * n
    scores = []
    for score, reason in answers:
        if score is not None and math.isfinite(score):
            scores.append(float(score))
            continue
        counters[f"{name}/{'error' if reason.startswith('error') else 'unparsed'}"] += 1
        scores.append(sub.fallback)
    return scores


async def with_model_rewards(
    v: VerifierConfig,
    names: list[str],
    clients: dict[str, Any],
    counters: dict[str, float],
    prompt: Prompt,
    texts: list[str],
    by_rules: Any,
    on_retry: Any = None,
) -> list[Any]:
    """The rule rewards' outputs (`by_rules`, awaitable: one output or None per text) and
    the model rewards of `names` asked for at once, then added (`add_model_rewards`)."""
    rules, by_model = await asyncio.gather(
        by_rules, model_scores(v, names, clients, counters, prompt, texts, on_retry)
    )
    return add_model_rewards(v, rules, by_model) if by_model else rules


def add_model_rewards(
    v: VerifierConfig, outputs: list[Any], scores: dict[str, list[float]]
) -> list[Any]:
    """The rule rewards' outputs (`RewardOutput`s, None where no rule reward runs) with each
    model reward added at its weight (`verifier.weights`, default 1) and named as a
    component; the rules' own total is the component `rules` when both kinds score."""
    from async_grpo.rewards import RewardOutput

    out = []
    for i, given in enumerate(outputs):
        rule = given if given is not None else RewardOutput(0.0)
        total, components = rule.reward, dict(rule.components)
        if scores and given is not None:
            components["rules"] = rule.reward
        for name, values in scores.items():
            components[name] = values[i]
            total += v.weights.get(name, 1.0) * values[i]
        out.append(RewardOutput(float(total), components, rule.reason))
    return out
