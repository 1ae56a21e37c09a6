"""The ExperienceBatcher in asyncio with scripted pools (the pools are not under test
here; they have their own integration tests): rounds to 2 ranks, equal minibatch counts,
EndOfBatch books, skipping, mask_truncated, the staleness gate, regeneration of stale
groups, retries, errors reaching every waiting rank, and where drops are counted."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from async_grpo.batcher import catch_up
from async_grpo.batcher.batcher import ExperienceBatcher
from async_grpo.batcher.types import EndOfBatch, Minibatch, PushNow
from async_grpo.config import BatcherConfig, LossConfig, RunConfig, TrainerConfig
from async_grpo.data import Prompt
from async_grpo.inference.types import (
    Completion,
    PoolUnavailable,
    RequestError,
    WorkerStatus,
)
from async_grpo.rewards import RewardOutput

BUDGET = 64


class ScriptedGeneration:
    """Completions of seeded random lengths, from the policy version the batcher last
    announced (or `versions_served`, in order, when given). `failures`: exceptions raised
    by the first calls, in order. Records (step, slot, attempt) of each call via the seed."""

    def __init__(self, batcher, failures=(), versions_served=(), truncate_every=0, slow=None):
        self.batcher, self.failures = batcher, list(failures)
        self.slow = slow or {}  # prompt length -> seconds its generation takes
        self.versions_served = list(versions_served)
        self.truncate_every = truncate_every
        self.calls: list[tuple[int, int]] = []  # (prompt length, version served)
        self.min_versions: list[int] = []  # the oldest version each call would accept
        self.retries = 0

    async def call(self, n, method, ids, n2, sampling, on_retry=None, min_version=-1):
        assert method == "generate" and n == n2
        self.min_versions.append(min_version)
        await asyncio.sleep(self.slow.get(len(ids), 0))
        if self.failures:
            raise self.failures.pop(0)
        version = self.versions_served.pop(0) if self.versions_served else self.batcher.version
        self.calls.append((len(ids), version))
        rng = random.Random(sampling.seed)
        out = []
        for i in range(n):
            k = rng.randint(1, 12)
            truncated = bool(self.truncate_every) and i % self.truncate_every == 0
            out.append(
                Completion(
                    [rng.randrange(100) for _ in range(k)],
                    [-1.0] * k,
                    "x" * k,
                    "length" if truncated else "stop",
                    version,
                )
            )
        return out


class ScriptedVerifier:
    """Reward = completion length mod 3 (groups mostly differ); `equal_groups`: the
    groups of these prompt lengths all get 1.0 (zero advantage)."""

    def __init__(self, equal_prompt_lens=()):
        self.equal = set(equal_prompt_lens)
        self.retries = 0

    async def call(self, n, method, items, on_retry=None):
        assert method == "score"
        if len(items[0].prompt) in self.equal:
            return [RewardOutput(1.0) for _ in items]
        return [RewardOutput(float(len(it.completion) % 3)) for it in items]


def _prompts(n=6):
    # prompt i has i + 3 tokens, so a group is known by its prompt length
    return [Prompt("p" * (i + 3), "a", list(range(i + 3))) for i in range(n)]


def _cfg(**batcher) -> RunConfig:
    b = BatcherConfig(
        questions_per_step=4, samples_per_question=4, max_tokens_per_gpu=BUDGET, **batcher
    )
    t = TrainerConfig(max_steps=3, loss=LossConfig())
    return replace(RunConfig(), batcher=b, trainer=t)


async def _drain(batcher, rank, timeout_s=30.0):
    """Everything `rank` receives for one step: its minibatches, then the EndOfBatch."""
    items = []
    while True:
        item = await batcher.get(rank, timeout_s)
        items.append(item)
        if isinstance(item, EndOfBatch):
            return items


def sent_samples(per_rank):
    """What the ranks received for one step, in a canonical order: (prompt, completion,
    advantage) of every sample."""
    return sorted(
        (tuple(s.prompt_ids), tuple(s.completion_ids), s.advantage)
        for items in per_rank
        for mb in items[:-1]
        for s in mb.samples
    )


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def _make(cfg, gen_kw=None, verifier_kw=None):
    b = ExperienceBatcher(cfg, _prompts(), num_ranks=2, clients={})
    gen = ScriptedGeneration(b, **(gen_kw or {}))
    b._clients = {"generation": gen, "verifier": ScriptedVerifier(**(verifier_kw or {}))}
    return b, gen


def _first_step(cfg, gen_kw=None, verifier_kw=None):
    """What both ranks receive for step 0 (version 0), then the batcher is stopped."""

    async def main():
        b, _ = _make(cfg, gen_kw, verifier_kw)
        await b.start(0)
        await b.set_version(0)
        per_rank = await asyncio.gather(_drain(b, 0), _drain(b, 1))
        await b.stop()
        return per_rank

    return _run(main())


def test_two_ranks_get_equal_rounds_and_balanced_books():
    per_rank = _first_step(_cfg())
    eobs = [items[-1] for items in per_rank]
    mbs = [[i for i in items if isinstance(i, Minibatch)] for items in per_rank]
    # the same on both ranks but for the timeline's spans, which only rank 0 writes
    assert replace(eobs[0], spans=[]) == eobs[1] and eobs[0].step == 0
    assert [s["what"] for s in eobs[0].spans] == ["score"] * len(eobs[0].spans) != []
    assert len(mbs[0]) == len(mbs[1]) == eobs[0].num_minibatches >= 1
    sent = [s for r in mbs for mb in r for s in mb.samples]
    for r in mbs:
        for mb in r:
            assert mb.num_tokens == sum(
                len(s.prompt_ids) + len(s.completion_ids) for s in mb.samples
            )
            assert mb.num_tokens <= BUDGET
    # every generated sample is either sent or counted as skipped, none twice
    assert len(sent) + eobs[0].skipped_samples == 16
    tokens = sum(len(s.completion_ids) for s in sent)
    assert eobs[0].global_tokens == tokens + eobs[0].skipped_tokens
    assert eobs[0].global_samples == len(sent) + eobs[0].skipped_samples
    assert eobs[0].stats["samples"] == 16.0
    _balanced(eobs[0].stats, planned=16, requested=16, trained=len(sent))


def _balanced(stats, **expected):
    """The step's sample books balance, and hold the `expected` samples/* counts."""
    assert stats["samples/unaccounted"] == 0.0
    came = stats["samples/requested"] + stats["samples/replayed"]
    assert came == stats["samples/trained"] + stats["samples/skipped"] + stats["samples/dropped"]
    delivered = stats["samples/trained"] + stats["samples/skipped"]
    assert stats["samples/planned"] == delivered + stats["samples/missing"]
    assert delivered == stats["samples"]
    for key, value in expected.items():
        assert stats[f"samples/{key}"] == value, key


def test_equal_reward_groups_are_counted_not_sent_and_truncated_ones_masked():
    cfg = _cfg()
    cfg.trainer.loss.mask_truncated = True
    # step 0 draws 4 prompts; every prompt's group gets equal rewards except the 3-token one
    per_rank = _first_step(cfg, {"truncate_every": 2}, {"equal_prompt_lens": [4, 5, 6, 7, 8]})
    eob = per_rank[0][-1]
    sent = [s for items in per_rank for mb in items[:-1] for s in mb.samples]
    skipped = eob.stats["skipped_samples"]
    assert skipped >= 4 and skipped % 4 == 0  # whole groups
    assert eob.skipped_samples == skipped // 2  # their truncated half carries no loss
    assert all(len(s.prompt_ids) == 3 for s in sent)  # only the unequal prompt is sent
    kept = [s for s in sent if not s.truncated]
    assert eob.global_samples - eob.skipped_samples == len(kept) < len(sent) or not sent
    assert eob.global_tokens - eob.skipped_tokens == sum(len(s.completion_ids) for s in kept)


def test_staleness_gate_and_stale_groups_regenerated():
    async def main():
        cfg = _cfg(max_off_policy_steps=0)
        # the first answer comes from version -1: staler than step 0 allows
        b, gen = _make(cfg, {"versions_served": [-1]})
        await b.start(0)
        await asyncio.sleep(0.2)
        assert gen.calls == [], "generation started before the workers served version 0"
        await b.set_version(0)
        step0 = await asyncio.gather(_drain(b, 0), _drain(b, 1))
        await asyncio.sleep(0.2)
        calls_before_push = len(gen.calls)
        await b.set_version(1)  # max_off_policy_steps=0: step 1 waits for version 1
        step1 = await asyncio.gather(_drain(b, 0), _drain(b, 1))
        await b.stop()
        return step0, step1, calls_before_push, gen.calls

    step0, step1, before_push, calls = _run(main())
    assert step0[0][-1].stats["dropped/stale"] == 4.0  # one group of 4, regenerated
    assert step0[0][-1].stats["samples"] == 16.0
    _balanced(step0[0][-1].stats, requested=20, regenerated=4, generated=20, scored=16)
    assert "dropped/stale" not in step1[0][-1].stats  # counted in its own step only
    _balanced(step1[0][-1].stats, requested=16, regenerated=0, dropped=0)
    assert before_push == 5  # step 0's 4 groups + 1 regeneration, nothing of step 1
    assert all(v == 1 for _, v in calls[5:])


def test_failed_attempts_are_retried_and_counted_in_their_step():
    fails = [PoolUnavailable("all busy"), TimeoutError("slow")]
    per_rank = _first_step(_cfg(), {"failures": fails})
    stats = per_rank[0][-1].stats
    assert stats["dropped/group_error"] == 8.0  # two attempts of 4 samples
    assert stats["samples"] == 16.0  # both groups came back on a later attempt
    _balanced(stats, requested=24, regenerated=8, generated=16, missing=0)


def test_a_bad_request_drops_only_its_group():
    stats = _first_step(_cfg(), {"failures": [RequestError("prompt too long")]})[0][-1].stats
    assert stats["dropped/bad_request"] == 4.0 and stats["samples"] == 12.0
    _balanced(stats, requested=16, generated=12, missing=4, dropped=4)


def test_an_unexpected_error_reaches_every_waiting_rank():
    async def main():
        b, _ = _make(_cfg(), {"failures": [ValueError("engine exploded")] * 8})
        await b.start(0)
        await b.set_version(0)
        results = await asyncio.gather(b.get(0, 30.0), b.get(1, 30.0), return_exceptions=True)
        later = await asyncio.gather(b.get(1, 1.0), return_exceptions=True)
        await b.stop()
        return results + later

    for r in _run(main()):
        assert isinstance(r, RuntimeError), r
        assert "ValueError: engine exploded" in str(r)


def test_production_stops_at_max_steps():
    async def main():
        cfg = _cfg(max_off_policy_steps=5)
        cfg.trainer.max_steps = 2
        b, gen = _make(cfg)
        await b.start(0)
        await b.set_version(0)
        for _ in range(2):
            await asyncio.gather(_drain(b, 0), _drain(b, 1))
        await asyncio.sleep(0.3)
        await b.stop()
        return gen.calls

    assert len(_run(main())) == 8  # 2 steps x 4 groups, nothing past the last step


def test_stop_cancels_and_awaits_groups_in_flight():
    started, finished = [], []

    class Hanging(ScriptedGeneration):
        async def call(self, n, method, ids, n2, sampling, on_retry=None, min_version=-1):
            started.append(1)
            try:
                await asyncio.sleep(3600)
            finally:
                finished.append(1)  # a real client releases its lease here

    async def main():
        b = ExperienceBatcher(_cfg(max_off_policy_steps=0), _prompts(), 2, clients={})
        b._clients = {"generation": Hanging(b), "verifier": ScriptedVerifier()}
        await b.start(0)
        await b.set_version(0)
        await asyncio.sleep(0.2)
        await b.stop()

    _run(main())
    assert len(started) == len(finished) == 4


@pytest.mark.parametrize("k", [1, 2])
def test_async_mode_generates_ahead_but_within_the_bound(k):
    async def main():
        cfg = _cfg(max_off_policy_steps=k)
        b, gen = _make(cfg)
        await b.start(0)
        await b.set_version(0)
        await asyncio.gather(_drain(b, 0), _drain(b, 1))
        await asyncio.sleep(0.3)  # version stays 0: steps 1..k may run, not k+1
        ahead = {v for _, v in gen.calls}
        n = len(gen.calls)
        await b.stop()
        return ahead, n, gen.min_versions

    ahead, n, min_versions = _run(main())
    assert ahead == {0}
    assert n == 4 * min(k + 1, 3)  # max_steps is 3
    # step s leases only workers serving version s - k or newer
    assert sorted(min_versions) == sorted(s - k for s in range(min(k + 1, 3)) for _ in range(4))


def test_fixed_lag_pending_groups_replay_on_resume():
    """With k=1, steps 0 and 1 start on version 0; `wait_generated` returns once both are
    generated; `pending(1)` is step 1's groups, and a batcher resumed at step 1 with them
    sends exactly those samples without generating step 1 again."""

    async def first_run():
        b, gen = _make(_cfg(max_off_policy_steps=1))
        await b.start(0)
        await b.set_version(0)
        await asyncio.gather(_drain(b, 0), _drain(b, 1))  # step 0 trained
        await b.wait_generated(30.0)
        pending = await b.pending(1)
        sent = await asyncio.gather(_drain(b, 0), _drain(b, 1))  # step 1, uninterrupted
        await b.stop()
        return pending, sent, len(gen.calls)

    async def resumed(pending):
        b, gen = _make(_cfg(max_off_policy_steps=1))
        await b.start(1, pending)
        await b.set_version(1)
        sent = await asyncio.gather(_drain(b, 0), _drain(b, 1))
        await b.wait_generated(30.0)
        await b.stop()
        return sent, gen.calls

    pending, sent, calls = _run(first_run())
    assert list(pending) == [1] and len(pending[1]) == 4 and calls == 8
    again, new_calls = _run(resumed(pending))
    assert new_calls and all(v == 1 for _, v in new_calls)  # only step 2 is generated

    assert sent_samples(again) == sent_samples(sent)
    _balanced(again[0][-1].stats, replayed=16, requested=0, generated=0)
    _balanced(sent[0][-1].stats, replayed=0, requested=16)
    assert again[0][-1].global_tokens == sent[0][-1].global_tokens


def test_lost_groups_are_one_line_with_the_drops_by_reason():
    from async_grpo.batcher.stats import ledger, lost_groups

    books = {
        "samples/planned": 8,
        "samples/requested": 16,
        "samples/regenerated": 12,
        "samples/missing": 4,
        "samples/trained": 4,
        "dropped/group_error": 12,
    }
    stats = ledger(books)
    assert stats["samples/unaccounted"] == 0
    line = lost_groups(0, stats)
    assert line.startswith("generation: 4/8 samples of step 1 never arrived")
    assert "group_error 12" in line
    assert lost_groups(0, ledger({"samples/planned": 8, "samples/trained": 8})) is None


def test_lost_groups_lead_with_what_the_failed_attempts_said():
    """A step whose groups never arrived because the environment could not work: the line
    names the environment and what it did, and on how many workers, before the symptom."""
    from async_grpo.batcher.stats import attempt_failure, failure_causes, ledger, lost_groups
    from async_grpo.environments.pool import EnvironmentFailed

    hung = "environment 'sandbox': reset hung past environment.step_timeout_s (30 s)"
    attempts = [
        EnvironmentFailed("acquire", hung, "env-1"),
        EnvironmentFailed("acquire", hung, "env-2"),
        EnvironmentFailed("acquire", hung, "env-2"),
        TimeoutError("environment worker did not acquire 4 instances within 40s"),
    ]
    failures: dict[str, set[str]] = {}
    for e in attempts:
        cause, worker = attempt_failure(e)
        failures.setdefault(cause, set()).add(worker)
    causes = failure_causes(failures)
    assert causes == [f"{hung} on 2 workers", str(attempts[-1])]
    stats = ledger({"samples/planned": 4, "samples/requested": 12, "samples/missing": 4,
                    "dropped/group_error": 12})  # fmt: skip
    line = lost_groups(0, stats, causes)
    assert line.startswith(f"{hung} on 2 workers; 4/4 samples of step 1 never arrived")
    assert f"group_error 12; then: {attempts[-1]}" in line


@pytest.mark.parametrize("bound, stops", [(1.0, False), (0.5, True), (0.6, False)])
def test_missing_samples_stop_the_run_at_the_configured_share(bound, stops):
    """4 of 8 samples never arrived: a warning line below `batcher.max_missing_fraction`
    of the step, a stop (exit 2) at it; by default only a step with nothing stops."""
    from async_grpo.batcher.stats import check_lost_groups, ledger
    from async_grpo.errors import UserError

    stats = ledger(
        {
            "samples/planned": 8,
            "samples/requested": 16,
            "samples/missing": 4,
            "samples/trained": 4,
            "dropped/group_error": 12,
        }
    )
    if stops:
        with pytest.raises(UserError, match=r"never arrived.*max_missing_fraction=0.5"):
            check_lost_groups(2, stats, bound)
    else:
        assert "4/8 samples of step 3 never arrived" in check_lost_groups(2, stats, bound)
    nothing = ledger(
        {
            "samples/planned": 8,
            "samples/requested": 24,
            "samples/missing": 8,
            "dropped/group_error": 24,
        }
    )
    with pytest.raises(UserError, match="8/8 samples"):
        check_lost_groups(0, nothing, 1.0)


class VersionRegistry:
    """The generation registry as the batcher's watcher sees it: workers and versions."""

    def __init__(self, versions):
        self.versions = versions  # worker id -> version served

    @property
    def status(self):
        outer = self

        class _Status:
            async def remote(self):
                return [
                    WorkerStatus(w, "generation", 8, 0, v, "", 0.0)
                    for w, v in outer.versions.items()
                ]

        return _Status()

    @property
    def handles(self):  # no worker handles: the busy clocks are not read here
        class _Handles:
            async def remote(self):
                return {}

        return _Handles()


def test_a_worker_behind_the_version_makes_every_rank_push_once(monkeypatch):
    """A generation worker serving an older version than the batcher's: every rank gets one
    PushNow (at the same place in its stream), once per version however long it lags;
    `wait_generated` returns early only once no worker serves the current version."""
    monkeypatch.setattr(catch_up, "VERSION_CHECK_S", 0.02)

    class Gated(ScriptedGeneration):  # step 0's four groups answer; later ones wait
        async def call(self, *args, **kwargs):
            self.started = getattr(self, "started", 0) + 1
            if self.started > 4:
                await asyncio.sleep(3600)
            return await super().call(*args, **kwargs)

    async def main():
        b = ExperienceBatcher(_cfg(max_off_policy_steps=1), _prompts(), 2, clients={})
        gen = Gated(b)
        gen.registry = VersionRegistry({"old": 2, "new": 0})
        b._clients = {"generation": gen, "verifier": ScriptedVerifier()}
        await b.start(0)
        await b.set_version(2)  # as if two steps were trained: the batcher is at version 2
        await asyncio.sleep(0.2)
        per_rank = [[], []]
        for r in (0, 1):
            while not isinstance(item := await b.get(r, 5), EndOfBatch):
                per_rank[r].append(item)
            per_rank[r].append(await b.get(r, 5))  # step 1 waits: the next item is a PushNow
        waiting = asyncio.ensure_future(b.wait_generated(30.0))
        await asyncio.sleep(0.3)
        held_while_one_serves_it = not waiting.done()
        gen.registry.versions["old"] = 0  # now nothing serves version 2
        await asyncio.wait_for(waiting, 5)  # returns: only the push can unblock generation
        await b.stop()
        return per_rank, held_while_one_serves_it, b.catch_ups

    per_rank, held, catch_ups = _run(main())
    pushes = [
        [i for i, item in enumerate(items) if isinstance(item, PushNow)] for items in per_rank
    ]
    assert len(pushes[0]) == 1 and pushes[0] == pushes[1]  # the same place on both ranks
    assert per_rank[0][pushes[0][0]].version == 2
    assert held and catch_ups == 1
