"""Spare groups in the ExperienceBatcher, with the scripted pools of test_batcher: swapped
in for equal-reward groups when finished in time, counted unused otherwise, given until a
trainer rank blocks, and the step's pending groups following the swap."""

from __future__ import annotations

import asyncio
import time

from test_batcher import (
    ScriptedGeneration,
    ScriptedVerifier,
    _balanced,
    _cfg,
    _drain,
    _prompts,
    _run,
)

from async_grpo.batcher.batcher import ExperienceBatcher


def _spare_run(seed, slow, equal, read_after_s=0.0):
    """Step 0 with two spare groups over 12 prompts: what both ranks receive (they start
    reading after `read_after_s`) and the step's pending groups."""

    async def main():
        cfg = _cfg(spare_groups=2, seed=seed)
        b = ExperienceBatcher(cfg, _prompts(12), num_ranks=2, clients={})
        gen = ScriptedGeneration(b, slow=slow(b))
        b._clients = {"generation": gen, "verifier": ScriptedVerifier(equal(b))}
        await b.start(0)
        await b.set_version(0)
        await asyncio.sleep(read_after_s)
        per_rank = await asyncio.gather(_drain(b, 0), _drain(b, 1))
        pending = await b.pending(0)
        await b.stop()
        return per_rank, pending

    return _run(main())


def _draws(b):
    regular = {b.sampler.index_at(i) + 3 for i in range(4)}  # prompt lengths
    spare = {b.spares.sampler.index_at(j) + 3 for j in range(2)}
    return regular, spare


SPARE_SEED = next(  # a seed whose spare prompts are not among the step's regular ones
    s
    for s in range(50)
    if not set.intersection(
        *_draws(
            ExperienceBatcher(_cfg(spare_groups=2, seed=s), _prompts(12), num_ranks=2, clients={})
        )
    )
)


def test_finished_spares_take_the_places_of_equal_reward_groups():
    # every regular group has equal rewards and is slow; the spares finish first, unequal
    per_rank, pending = _spare_run(
        SPARE_SEED,
        slow=lambda b: dict.fromkeys(_draws(b)[0], 0.3),
        equal=lambda b: _draws(b)[0],
    )
    regular, spare = _draws(
        ExperienceBatcher(
            _cfg(spare_groups=2, seed=SPARE_SEED), _prompts(12), num_ranks=2, clients={}
        )
    )
    eob = per_rank[0][-1]
    sent = [s for items in per_rank for mb in items[:-1] for s in mb.samples]
    assert {len(s.prompt_ids) for s in sent} == spare and len(sent) == 8
    assert eob.stats["spare_groups_used"] == 2.0 and eob.stats["skipped_samples"] == 8.0
    _balanced(eob.stats, planned=16, requested=24, trained=8, skipped=8)
    assert eob.stats["dropped/replaced_by_spare"] == 8.0
    assert eob.stats.get("dropped/spare_unused", 0.0) == 0.0
    # the groups the spares replaced (all 1.0) count in the reward of what was scored
    trained_sum = eob.stats["reward/trained_mean"] * 16
    assert abs(eob.stats["reward/mean"] - (trained_sum + 8 * 1.0) / 24) < 1e-9
    # a checkpoint keeps the step as it was packed: two slots hold the spares now
    lens = sorted(len(g[0].prompt_ids) for g in pending[0])
    assert len(lens) == 4 and set(lens) > spare and set(lens) - spare < regular


def test_spares_not_ready_or_equal_are_counted_unused_and_never_delay_the_step():
    spare_lens = {}

    def slow(b):  # the first spare takes far longer than the step
        first = b.spares.sampler.index_at(0) + 3
        spare_lens["slow"] = first
        return {first: 30.0}

    def equal(b):  # the second spare and one regular group have equal rewards
        regular, _ = _draws(b)
        return {b.spares.sampler.index_at(1) + 3, min(regular)}

    t0 = time.monotonic()
    per_rank, pending = _spare_run(SPARE_SEED, slow, equal)
    eob = per_rank[0][-1]
    assert time.monotonic() - t0 < 20  # the slow spare would take 30 s
    assert eob.stats["spare_groups_used"] == 0.0 and eob.stats["skipped_samples"] == 4.0
    _balanced(eob.stats, planned=16, requested=24, trained=12, skipped=4)
    assert eob.stats["dropped/spare_unused"] == 8.0  # one cancelled, one equal
    assert all(len(g[0].prompt_ids) != spare_lens["slow"] for g in pending[0])


def test_spares_get_until_the_trainer_needs_the_step():
    # the regular groups are fast, one with equal rewards; the spares take 0.3 s, and the
    # ranks are busy for 2 s: packing waits for the spares while minibatches are queued
    def equal(b):
        return {min(_draws(b)[0])}

    per_rank, _ = _spare_run(
        SPARE_SEED, lambda b: dict.fromkeys(_draws(b)[1], 0.3), equal, read_after_s=2.0
    )
    eob = per_rank[0][-1]
    assert eob.stats["spare_groups_used"] == 1.0 and eob.stats["skipped_samples"] == 0.0
    _balanced(eob.stats, planned=16, requested=24, trained=16, skipped=0)
    assert eob.stats["dropped/replaced_by_spare"] == eob.stats["dropped/spare_unused"] == 4.0


def test_spares_still_running_are_cancelled_before_a_push():
    """`wait_generated` (rank 0, before a push or a save) returns once the regular groups
    of the started steps are done and cancels their spares still running: a push in `wait`
    mode lets the engine finish every request it runs, so a running spare would hold it.
    Step 0 is trained; step 1 (one step ahead) has a spare that would take 30 s."""

    def batcher(seed):
        cfg = _cfg(spare_groups=2, seed=seed, max_off_policy_steps=1)
        return ExperienceBatcher(cfg, _prompts(12), 2, clients={})

    def slow_spare(b):  # step 1's first spare, by its prompt's length
        return b.spares.index(1, 0) + 3

    seed = next(  # no regular group of steps 0 and 1 shares that prompt
        s
        for s in range(50)
        if slow_spare(batcher(s)) not in {batcher(s).sampler.index_at(i) + 3 for i in range(8)}
    )

    async def main():
        b = batcher(seed)
        b._clients = {
            "generation": ScriptedGeneration(b, slow={slow_spare(b): 30.0}),
            "verifier": ScriptedVerifier(set()),
        }
        await b.start(0)
        await b.set_version(0)
        await asyncio.gather(_drain(b, 0), _drain(b, 1))  # step 0 trained
        step1 = b.spares._tasks[1]
        t = time.monotonic()
        await b.wait_generated(20.0)
        waited = time.monotonic() - t
        gone_before_the_push = step1[0].cancelled()
        await b.set_version(1)  # the push
        per_rank = await asyncio.gather(_drain(b, 0), _drain(b, 1))
        await b.stop()
        return waited, gone_before_the_push, per_rank[0][-1]

    waited, gone_before_the_push, eob = _run(main())
    assert waited < 10 and gone_before_the_push
    assert eob.stats["dropped/spare_unused"] >= 4.0
    _balanced(eob.stats, planned=16, requested=24, trained=16, skipped=0)
