"""Several optimizer updates per batch on the batcher's side (`trainer.mini_batches`), with
the scripted pools of test_batcher: the parts, their order and their counts."""

from __future__ import annotations

from dataclasses import replace

from test_batcher import _cfg, _first_step, _prompts

from async_grpo.batcher.batcher import ExperienceBatcher


def test_several_updates_get_parts_of_whole_groups_in_slot_order():
    """`trainer.mini_batches: 2`: the step's groups, in slot order whatever order they
    finished in (slot 0's is slowest here), split into 2 parts of whole groups, each part
    packed into rounds of its own with its last round marked; the EndOfBatch carries each
    part's counts."""
    cfg = _cfg()
    cfg = replace(cfg, trainer=replace(cfg.trainer, mini_batches=2))
    probe = ExperienceBatcher(cfg, _prompts(), num_ranks=2, clients={})
    lens = [probe.sampler.index_at(slot) + 3 for slot in range(4)]  # prompt length by slot
    per_rank = _first_step(cfg, {"slow": {lens[0]: 0.3}})
    eob = per_rank[0][-1]
    part_lens: dict[int, set[int]] = {0: set(), 1: set()}
    for items in per_rank:
        mbs = items[:-1]
        assert [mb.part for mb in mbs] == sorted(mb.part for mb in mbs)
        for m in (0, 1):
            flags = [mb.last for mb in mbs if mb.part == m]
            assert flags and flags == [False] * (len(flags) - 1) + [True]
            part_lens[m] |= {len(s.prompt_ids) for mb in mbs if mb.part == m for s in mb.samples}
    assert part_lens[0] and part_lens[1] and not part_lens[0] & part_lens[1]  # whole groups
    assert part_lens[0] <= set(lens[:2]) and part_lens[1] <= set(lens[2:])
    tokens = sum(t for t, _ in eob.part_counts)
    samples = sum(n for _, n in eob.part_counts)
    assert len(eob.part_counts) == 2
    assert (tokens, samples) == (
        eob.global_tokens - eob.skipped_tokens,
        eob.global_samples - eob.skipped_samples,
    )
