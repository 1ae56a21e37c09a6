"""What the batcher reports with each step: the sample books, the batch's statistics and
the pools' counters. Pure functions over what the batcher holds (the pool counters ask the
registries and verifier workers), so the books' identities are tested alone."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from async_grpo.batcher.model_scores import model_counter_keys
from async_grpo.batcher.types import ScoredSample
from async_grpo.environments.pool import STATS_KEYS as ENV_STATS_KEYS
from async_grpo.errors import UserError

POOL_STATS_TIMEOUT_S = 60.0

BOOK_KEYS = (
    "planned",
    "requested",
    "regenerated",
    "reissued",
    "replayed",
    "generated",
    "scored",
    "trained",
    "skipped",
    "missing",
    "dropped",
)


def ledger(books: dict[str, float]) -> dict[str, float]:
    """One step's sample books as metrics: every samples/* key (0 when nothing happened),
    samples/dropped the sum of the dropped/<reason> counts, and samples/unaccounted, which
    is 0 when the books balance:

        requested + replayed = trained + skipped + dropped   (each sample leaves once)
        planned = trained + skipped + missing                (each slot delivers or is missing)
    """
    out = {f"samples/{k}": float(books.get(f"samples/{k}", 0.0)) for k in BOOK_KEYS}
    drops = {k: float(v) for k, v in books.items() if k.startswith("dropped/")}
    out["samples/dropped"] = sum(drops.values(), 0.0)
    out |= drops
    came = out["samples/requested"] + out["samples/replayed"]
    left = out["samples/trained"] + out["samples/skipped"] + out["samples/dropped"]
    slots = out["samples/trained"] + out["samples/skipped"] + out["samples/missing"]
    out["samples/unaccounted"] = abs(came - left) + abs(out["samples/planned"] - slots)
    return out


def drain_counters(b: Any, step: int) -> dict[str, float]:
    """The ExperienceBatcher `b`'s books and drops of `step` (every group of the step has
    reported by now), the model rewards' outcomes and the run's packing efficiency so far; its failure reasons and
    causes kept for the trainer to ask."""
    out = ledger(b.books.pop(step, {}))
    failed, scored, reasons = b.score_failures.pop(step, [0, 0, []])
    out["verifier/step_failures"], out["verifier/step_scored"] = float(failed), float(scored)
    b.failure_reasons[step] = reasons
    b.failure_reasons.pop(step - 16, None)  # bounded: the trainer asks within a step
    b.group_causes[step] = failure_causes(b.group_failures.pop(step, {}))
    b.group_causes.pop(step - 16, None)
    out |= {k: float(b.counters.get(k, 0.0)) for k in model_counter_keys(b.cfg)}
    budget = b.counters.get("packed_budget", 0.0)
    if budget:
        out["packing_efficiency"] = b.counters["packed_tokens"] / budget
    return out


def loss_counts(samples: Sequence[ScoredSample], mask_truncated: bool) -> tuple[int, int]:
    """(loss tokens, samples with a loss token) of `samples`: what normalises the loss."""
    kept = [s for s in samples if not (mask_truncated and s.truncated) and s.loss_tokens]
    return sum(s.loss_tokens for s in kept), len(kept)


def batch_stats(
    step: int,
    groups: list[list[ScoredSample]],
    wait_s: float,
    set_aside: Sequence[list[ScoredSample]] = (),
) -> dict[str, float]:
    """Rewards, lengths, staleness and the like over the groups that step `step` trains.

    `reward/mean` is over every group the step generated and scored: the trained ones and
    `set_aside`, those that dynamic sampling redrew or a spare replaced (equal rewards,
    often all correct). It is what the policy scores, and what `trainer.stop_at_reward`
    reads; `reward/trained_mean` is over the trained groups alone."""
    samples = [s for g in groups for s in g]
    if not samples:
        return {"samples": 0.0}
    mean = lambda xs: float(sum(xs) / len(xs)) if xs else 0.0  # noqa: E731
    scored = samples + [s for g in set_aside for s in g]
    stats = {
        "samples": float(len(samples)),
        "reward/mean": mean([s.reward for s in scored]),
        "reward/trained_mean": mean([s.reward for s in samples]),
        "reward/max_in_group_mean": mean([max(s.reward for s in g) for g in groups]),
        "output_length/mean": mean([len(s.completion_ids) for s in samples]),
        "truncated_fraction": mean([float(s.truncated) for s in samples]),
        "zero_advantage_fraction": mean([float(len({s.reward for s in g}) == 1) for g in groups]),
        "staleness/mean": mean([step - s.version for s in samples]),
        "staleness/max": float(max(step - s.version for s in samples)),
        "staleness/token_mean": token_staleness(step, samples),
        "samples/mixed_versions": mean([float(s.token_versions is not None) for s in samples]),
        "time/batch_assembly": wait_s,
    }
    for key in sorted({k for s in samples for k in s.components}):
        stats[f"reward/{key}"] = mean([s.components.get(key, 0.0) for s in samples])
    episodes = [s.episode for s in samples if s.episode is not None]
    if episodes:
        stats |= episode_stats(episodes)
    return stats


def draw_stats(
    b: Any,
    groups: list[list[ScoredSample]],
    spares_used: int,
    redraws: float,
    redrawn: list[list[ScoredSample]],
) -> dict[str, float]:
    """What a step's spare groups and dynamic sampling did, for those the run has on
    (`b`: its BatcherConfig): spares used; groups redrawn, replaced and left equal."""
    out: dict[str, float] = {}
    if b.spare_groups:
        out["spare_groups_used"] = float(spares_used)
    if b.dynamic_sampling:
        out["dynamic_sampling/redraws"] = redraws
        out["dynamic_sampling/replaced"] = float(len(redrawn))
        equal = [g for g in groups if all(s.advantage == 0.0 for s in g)]
        out["dynamic_sampling/left_equal"] = float(len(equal))
    return out


def token_staleness(step: int, samples: list[ScoredSample]) -> float:
    """Mean staleness over the model's completion tokens (an episode's environment tokens
    were not sampled): each counts the version that sampled it (after an in-flight update
    a sample's tokens come from several versions)."""
    total = count = 0
    for s in samples:
        versions = s.token_versions or [s.version] * len(s.completion_ids)
        mask = s.completion_mask or [True] * len(versions)
        model = [v for v, m in zip(versions, mask, strict=True) if m]
        total += sum(step - v for v in model)
        count += len(model)
    return total / count if count else 0.0


def episode_stats(episodes: list[dict[str, float]]) -> dict[str, float]:
    """Multi-turn figures over a step's episodes: turns and environment-reported counts
    (`info/tool_calls` -> `tool_calls/mean`) per episode, the mean environment step time,
    and the episodes that ended on an environment error, by reason; for a harness's
    rollouts, their mean seconds and the prefix breaks (endpoint.py)."""
    total = lambda key: sum(e.get(key, 0.0) for e in episodes)  # noqa: E731
    steps = total("env_steps")
    out = {
        "turns/mean": total("turns") / len(episodes),
        "env/step_time": total("env_step_s") / steps if steps else 0.0,
        "env/errors": total("env_errors"),
        "env/observations_cut": total("observation_cut"),
        "env/observations_not_unicode": total("observation_not_unicode"),
    }
    if any("rollout_s" in e for e in episodes):  # a harness's rollouts
        out["env/rollout_time"] = total("rollout_s") / len(episodes)
        out["env/prefix_breaks"] = total("prefix_breaks")
    for key in sorted({k for e in episodes for k in e}):
        if key.startswith("info/"):
            out[f"{key[5:]}/mean"] = total(key) / len(episodes)
        elif key.startswith("env_errors/"):
            out[f"env/errors/{key[11:]}"] = total(key)
    return out


async def pool_counters(clients: dict[str, Any]) -> dict[str, float]:
    """Counters kept by the pools since the start: requests retried after a worker died
    and dead workers replaced (every pool), and the verifier's and environment workers'
    own counters (summed over the live workers: a dead one takes its counts with it)."""
    out = {f"pool/{name}_retries": float(getattr(c, "retries", 0)) for name, c in clients.items()}
    if not any(getattr(clients.get(name), "registry", None) for name in WORKER_COUNTERS):
        return out  # scripted pools (the batcher's unit tests) keep no registries
    try:
        async with asyncio.timeout(POOL_STATS_TIMEOUT_S):
            for name, c in clients.items():
                if getattr(c, "registry", None) is not None:
                    out[f"pool/{name}/restarts"] = float(await c.registry.restart_count.remote())
            for name, keys in WORKER_COUNTERS.items():
                if getattr(clients.get(name), "registry", None) is not None:
                    out |= await _worker_counters(clients[name].registry, keys)
    except TimeoutError:
        print(
            f"batcher: pool counters not answered within {POOL_STATS_TIMEOUT_S:.0f}s;"
            " this step's pool counters are left out",
            flush=True,
        )
    return out


WORKER_COUNTERS = {
    "verifier": ("verifier/timeouts", "verifier/errors", "verifier/scored"),
    "environment": tuple(f"env/{k}" for k in ENV_STATS_KEYS) + ("env/live",),
}


async def _worker_counters(registry: Any, keys: tuple[str, ...]) -> dict[str, float]:
    handles = await registry.handles.remote()
    answers = await asyncio.gather(
        *(h.stats.remote() for h in handles.values()), return_exceptions=True
    )
    per_worker = [a for a in answers if isinstance(a, dict)]  # the dead say nothing
    return {key: float(sum(w.get(key, 0) for w in per_worker)) for key in keys}


class PoolClock:
    """The generation pool's busy fraction and busy stretches, from the workers' clocks
    (`BusyClock`), read once per step: the busy fraction over the window since the last
    reading and since the first one (the batcher's start). A worker that joined inside a
    window counts from its start; one that died takes its last window with it."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[float, float]] = {}  # worker -> (busy s, up s) read last
        self.since: dict[str, float] = {}  # worker -> wall time its stretches were read to
        self.busy_s = self.up_s = 0.0  # summed over the windows after the first reading
        self.first = True

    async def read(self, client: Any) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """This window's metrics and the workers' busy stretches as timeline spans
        (`async_grpo.timeline`)."""
        readings = await generation_clocks(client, self.since)
        spans = [
            {"lane": r["worker_id"], "what": "generate", "start": a, "end": b, "version": v}
            for r in readings
            for a, b, v in r["spans"]
        ]
        return self.add(readings), spans

    def add(self, clocks: list[dict[str, Any]]) -> dict[str, float]:
        busy = up = 0.0
        for c in clocks:
            b0, u0 = self.seen.get(c["worker_id"], (0.0, 0.0))
            busy, up = busy + c["busy_s"] - b0, up + c["up_s"] - u0
            self.seen[c["worker_id"]] = (c["busy_s"], c["up_s"])
        if self.first:  # the time before the run (start-up) is not the run's
            self.first = False
            return {}
        self.busy_s, self.up_s = self.busy_s + busy, self.up_s + up
        out = {}
        if up > 0:
            out["pool/generation/busy_fraction"] = busy / up
        if self.up_s > 0:
            out["pool/generation/busy_fraction_run"] = self.busy_s / self.up_s
        return out


async def generation_clocks(client: Any, since: dict[str, float]) -> list[dict[str, Any]]:
    """Every live generation worker's clock reading (`RegisteredWorker.clock_reading`) with
    its busy stretches after `since[worker]` (0: all it kept), which is moved on to the
    worker's time of reading; [] without a registry or when it does not answer in time."""
    registry = getattr(client, "registry", None)
    if registry is None:
        return []
    try:
        async with asyncio.timeout(POOL_STATS_TIMEOUT_S):
            handles = await registry.handles.remote()
            answers = await asyncio.gather(
                *(h.clock_reading.remote(since.get(w, 0.0)) for w, h in handles.items()),
                return_exceptions=True,
            )
    except TimeoutError:
        print(
            f"batcher: generation workers' clocks not read within {POOL_STATS_TIMEOUT_S:.0f}s;"
            " this step's busy fraction is left out",
            flush=True,
        )
        return []
    readings = [a for a in answers if isinstance(a, dict)]  # the dead say nothing
    for r in readings:
        since[r["worker_id"]] = r["now"]
    return readings


def samples_to_log(step: int, groups: list[list[ScoredSample]], cfg: Any) -> list[dict]:
    """Every `cfg.sample_every` steps, `cfg.samples_logged` samples spread over the step's
    groups (sample i from group i mod G, then the next sample of each), for samples.jsonl."""
    every, k = cfg.sample_every, cfg.samples_logged
    if not every or (step + 1) % every or not groups:
        return []
    picked = []
    for i in range(min(k, sum(len(g) for g in groups))):
        group = groups[i % len(groups)]
        if i // len(groups) < len(group):
            picked.append(group[i // len(groups)].to_log(step))
    return picked


def attempt_failure(e: BaseException) -> tuple[str, str]:
    """What a failed group attempt says, on one line, and the worker it names ("" if none):
    an actor's own error, not Ray's wrapper around it (whose text is the remote traceback)."""
    own = getattr(e, "cause", None) or e
    return " ".join(str(own).split()) or type(own).__name__, getattr(own, "worker", "")


def failure_causes(failures: dict[str, set[str]], limit: int = 3) -> list[str]:
    """The causes of a step's failed group attempts (cause -> the workers that said it),
    first seen first: `environment 'calc': reset hung past ... on 3 workers`."""
    return [
        f"{cause} on {len(workers)} workers" if len(workers) > 1 else cause
        for cause, workers in list(failures.items())[:limit]
    ]


def lost_groups(step: int, stats: dict[str, float], causes: Sequence[str] = ()) -> str | None:
    """One line if groups of `step` were given up (every attempt failed), with the drops by
    reason; None if every group arrived. It leads with the first of `causes` (what the
    failed attempts said, `failure_causes`): the cause, not the symptom."""
    missing = stats.get("samples/missing", 0)
    if not missing:
        return None
    drops = ", ".join(
        f"{k.removeprefix('dropped/')} {v:.0f}"
        for k, v in sorted(stats.items())
        if k.startswith("dropped/") and v
    )
    others = "".join(f"; then: {c}" for c in causes[1:])
    planned = stats.get("samples/planned", 0)
    lost = f"{missing:.0f}/{planned:.0f} samples of step {step + 1} never arrived"
    return (
        f"{f'{causes[0]}; ' if causes else 'generation: '}{lost}"
        f" (dropped samples by reason: {drops or 'none'}{others};"
        " see OUTPUT_DIR/logs/batcher.log)"
    )


def check_lost_groups(
    step: int, stats: dict[str, float], bound: float, causes: Sequence[str] = ()
) -> str | None:
    """`lost_groups`' line as a warning, or a UserError (exit 2) once the missing samples
    reach `bound` (batcher.max_missing_fraction) of the step's planned samples."""
    line = lost_groups(step, stats, causes)
    if line and stats.get("samples/missing", 0) >= bound * stats.get("samples/planned", 0):
        raise UserError(f"{line}; stopping (batcher.max_missing_fraction={bound:g})")
    return line
