"""DAPO's soft overlong penalty: by hand, and applied by the batcher before advantages."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch
from test_batcher import ScriptedGeneration, ScriptedVerifier, _cfg, _drain, _prompts, _run

from async_grpo.batcher.batcher import ExperienceBatcher
from async_grpo.config import OverlongConfig, VerifierConfig
from async_grpo.core.advantages import group_advantages
from async_grpo.rewards.overlong import overlong_penalty


@pytest.mark.parametrize(
    "length, want",
    [(1, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (16, -1.0)],  # limit 16, buffer 4
)
def test_the_penalty_ramps_over_the_buffer(length, want):
    assert overlong_penalty(length, 16, OverlongConfig(buffer=4)) == pytest.approx(want)
    half = OverlongConfig(buffer=4, penalty=0.5)  # verl's penalty_factor
    assert overlong_penalty(length, 16, half) == pytest.approx(want / 2)
    assert overlong_penalty(length, 16, OverlongConfig()) == 0.0  # buffer 0: off


def test_the_batcher_adds_it_as_a_component_before_the_advantages():
    # scripted completions have 1..12 tokens; limit 12 and a buffer of 4 penalise 9..12
    cfg = _cfg()
    cfg = replace(
        cfg,
        generation=replace(cfg.generation, max_new_tokens=12),
        verifier=VerifierConfig(overlong=OverlongConfig(buffer=4)),
    )

    async def main():
        b = ExperienceBatcher(cfg, _prompts(), num_ranks=2, clients={})
        b._clients = {"generation": ScriptedGeneration(b), "verifier": ScriptedVerifier()}
        await b.start(0)
        await b.set_version(0)
        per_rank = await asyncio.gather(_drain(b, 0), _drain(b, 1))
        await b.stop()
        return per_rank

    per_rank = _run(main())
    samples = [s for items in per_rank for mb in items[:-1] for s in mb.samples]
    assert per_rank[0][-1].stats["reward/overlong"] < 0.0  # some run into the ramp
    groups: dict[int, list] = {}
    for s in samples:
        groups.setdefault(len(s.prompt_ids), []).append(s)
    for group in groups.values():  # the advantages are those of reward + penalty
        lengths = [len(s.completion_ids) for s in group]
        rewards = [n % 3 + overlong_penalty(n, 12, OverlongConfig(buffer=4)) for n in lengths]
        want, _ = group_advantages(torch.tensor(rewards), True)
        got = [s.advantage for s in group]
        assert got == pytest.approx(want.tolist(), abs=1e-6)
