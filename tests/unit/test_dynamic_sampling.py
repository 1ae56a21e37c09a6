"""Dynamic sampling (`batcher.dynamic_sampling`) in the ExperienceBatcher, with the
scripted pools of test_batcher: an equal-reward group is redrawn from a fresh prompt up to
the bound, the books balance, a push waits for the redraws, and a resumed run trains the
same groups without drawing them again."""

from __future__ import annotations

import asyncio

from test_batcher import (
    ScriptedGeneration,
    ScriptedVerifier,
    _balanced,
    _cfg,
    _drain,
    _prompts,
    _run,
    sent_samples,
)

from async_grpo.batcher.batcher import ExperienceBatcher

Q, N = 4, 4  # questions per step, samples per question (test_batcher's _cfg)


def _batcher(cfg, equal_lens):
    b = ExperienceBatcher(cfg, _prompts(12), num_ranks=2, clients={})
    b._clients = {"generation": ScriptedGeneration(b), "verifier": ScriptedVerifier(equal_lens)}
    return b


def _regular_lens(b, step):
    return [b.sampler.index_at(step * Q + slot) + 3 for slot in range(Q)]  # prompt lengths


def _expected(b, step, equal_lens, bound):
    """Each slot's final prompt length and the step's redraws, by the batcher's own draws."""
    finals, redraws = [], 0
    for slot, length in enumerate(_regular_lens(b, step)):
        for attempt in range(bound):
            if length not in equal_lens:
                break
            redraws += 1
            length = b.spares.redraw_index(step, slot, attempt) + 3
        finals.append(length)
    return finals, redraws


def _sent_lens(per_rank):
    return sorted(
        {len(s.prompt_ids) for items in per_rank for mb in items[:-1] for s in mb.samples}
    )


def _first_step(bound, equal):
    async def main():
        b = _batcher(_cfg(dynamic_sampling=bound, seed=3), equal(b_probe))
        await b.start(0)
        await b.set_version(0)
        per_rank = await asyncio.gather(_drain(b, 0), _drain(b, 1))
        await b.stop()
        return per_rank

    b_probe = ExperienceBatcher(_cfg(dynamic_sampling=bound, seed=3), _prompts(12), 2, {})
    return b_probe, _run(main())


def test_equal_reward_groups_are_redrawn_until_they_carry_a_gradient():
    b, per_rank = _first_step(2, lambda b: set(_regular_lens(b, 0)))
    equal = set(_regular_lens(b, 0))
    finals, redraws = _expected(b, 0, equal, 2)
    eob = per_rank[0][-1]
    left = sum(length in equal for length in finals)
    assert redraws >= Q and eob.stats["dynamic_sampling/redraws"] == redraws
    assert eob.stats["dynamic_sampling/replaced"] == redraws  # every try made a group
    assert eob.stats["dynamic_sampling/left_equal"] == left
    assert _sent_lens(per_rank) == sorted({x for x in finals if x not in equal})
    _balanced(
        eob.stats,
        planned=Q * N,
        requested=Q * N + redraws * N,
        trained=(Q - left) * N,
        skipped=left * N,
    )
    assert eob.stats["dropped/redrawn"] == redraws * N
    # the reward of every group scored: the trained ones and the redrawn ones (all 1.0)
    trained_sum = eob.stats["reward/trained_mean"] * Q * N
    want = (trained_sum + redraws * N * 1.0) / ((Q + redraws) * N)
    assert abs(eob.stats["reward/mean"] - want) < 1e-9
    assert eob.stats["reward/mean"] != eob.stats["reward/trained_mean"]


def test_redraws_stop_at_the_bound_and_the_group_is_set_aside():
    every = set(range(3, 15))  # every prompt gives equal rewards
    _, per_rank = _first_step(2, lambda b: every)
    eob = per_rank[0][-1]
    assert eob.stats["dynamic_sampling/redraws"] == 2 * Q  # 2 per slot, no more
    assert eob.stats["dynamic_sampling/left_equal"] == Q
    _balanced(eob.stats, planned=16, requested=16 + 32, trained=0, skipped=16)
    assert eob.stats["dropped/redrawn"] == 32


def test_a_push_waits_for_redraws_and_a_resumed_run_trains_the_same_groups():
    """k = 1: steps 0 and 1 are generated under version 0, redraws included, before
    `wait_generated` returns; the checkpoint's pending step 1 holds the redrawn groups, and
    a batcher resumed with them sends exactly those samples without drawing again."""
    cfg = _cfg(dynamic_sampling=1, max_off_policy_steps=1, seed=3)
    probe = ExperienceBatcher(cfg, _prompts(12), 2, {})
    equal = set(_regular_lens(probe, 1))

    async def first_run():
        b = _batcher(cfg, equal)
        await b.start(0)
        await b.set_version(0)
        await asyncio.gather(_drain(b, 0), _drain(b, 1))  # step 0 trained
        await b.wait_generated(30.0)
        calls, pending = len(b._clients["generation"].calls), await b.pending(1)
        sent = await asyncio.gather(_drain(b, 0), _drain(b, 1))  # step 1, uninterrupted
        assert len(b._clients["generation"].calls) == calls  # nothing drawn after the wait
        await b.stop()
        return pending, sent

    async def resumed(pending):
        b = _batcher(cfg, equal)
        await b.start(1, pending)
        await b.set_version(1)
        sent = await asyncio.gather(_drain(b, 0), _drain(b, 1))
        await b.stop()
        return sent, b._clients["generation"].calls

    pending, sent = _run(first_run())
    assert sent[0][-1].stats["dynamic_sampling/replaced"] >= 1
    again, calls = _run(resumed(pending))
    assert all(v == 1 for _, v in calls)  # only step 2 is generated, under version 1

    assert sent_samples(again) == sent_samples(sent) and sent_samples(sent)
    _balanced(again[0][-1].stats, replayed=16, requested=0, generated=0)
    assert again[0][-1].global_tokens == sent[0][-1].global_tokens
