"""The curriculum: prompts always or never solved are drawn less, the draws of a step use
only steps already trained under the lag, and a resumed table draws exactly the same."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace

import pytest

from async_grpo.batcher.types import EndOfBatch
from async_grpo.config import BatcherConfig, ConfigError
from async_grpo.data.curriculum import Curriculum
from async_grpo.preflight.settings import load_config


def _solve(index: int, step: int) -> int:
    """Passes of 8: prompts 0-3 always, 4-5 never, 6-9 half the time."""
    return 8 if index < 4 else 0 if index < 6 else 4


def _play(cur: Curriculum, steps: range, q: int = 4) -> list[list[int]]:
    drawn = []
    for step in steps:
        picks = cur.draw(step, q)
        drawn.append(picks)
        for i in picks:
            cur.record(step, i, _solve(i, step), 8)
    return drawn


def test_weights_follow_mastery_worked_by_hand():
    cur = Curriculum(3, seed=0, lag=0, floor=0.1)
    assert cur.weight(0) == pytest.approx(1.1)  # unseen: m = 1/2, 0.1 + 4 * 1/4
    cur.record(0, 0, 8, 8)  # m = 9/10: 0.1 + 4 * 0.9 * 0.1 = 0.46
    cur.record(0, 1, 0, 8)  # m = 1/10: the same weight
    cur.record(0, 2, 4, 8)  # m = 1/2
    cur.draw(1, 1)  # folds step 0
    assert [round(cur.weight(i), 4) for i in range(3)] == [0.46, 0.46, 1.1]


def test_solved_and_hopeless_prompts_are_drawn_less():
    counts = Counter(i for picks in _play(Curriculum(10, 0, lag=1), range(200))[50:] for i in picks)
    solved, hopeless, mixed = (
        sum(counts[i] for i in r) / len(r) for r in ([0, 1, 2, 3], [4, 5], [6, 7, 8, 9])
    )
    assert mixed > 2.5 * max(solved, hopeless), counts
    assert all(len(set(p)) == 4 for p in _play(Curriculum(10, 0, lag=1), range(20)))  # distinct


def test_a_step_draws_only_from_steps_the_lag_has_trained():
    cur = Curriculum(10, 0, lag=1)
    cur.record(0, 0, 8, 8)
    cur.record(1, 1, 8, 8)  # not yet trained when step 2 is drawn (lag 1)
    cur.draw(2, 2)
    assert cur.samples[0] == 8 and cur.samples[1] == 0 and cur.folded_through == 0


def test_a_resumed_table_draws_exactly_the_same():
    full = Curriculum(10, 7, lag=1)
    whole = _play(full, range(30))
    first = Curriculum(10, 7, lag=1)
    head = _play(first, range(12))
    state = first.state_dict(through=10)  # checkpoint after step 10; step 11 is pending
    resumed = Curriculum(10, 7, lag=1)
    resumed.load_state_dict(state)
    for i in head[11]:  # the pending step is replayed, its results recorded again
        resumed.record(11, i, _solve(i, 11), 8)
    resumed.record(10, 0, 8, 8)  # a step already in the table is not counted twice
    assert head + _play(resumed, range(12, 30)) == whole
    with pytest.raises(ValueError, match="for 10 prompts, not 11"):
        Curriculum(11, 7, lag=1).load_state_dict(state)


def test_config_refuses_a_zero_floor():
    with pytest.raises(ConfigError, match="curriculum_floor"):
        load_config(None, ["batcher.curriculum=true", "batcher.curriculum_floor=0"])


@pytest.mark.parametrize("fail", [False, True], ids=["all-made", "one-failed"])
def test_the_batcher_draws_by_mastery_and_reports_it(fail):
    """A group that failed counts as seen and never passing: a prompt that always fails
    is drawn less, not with an unseen prompt's weight (11x a mastered one's)."""
    from test_batcher import BUDGET, _cfg, _make

    from async_grpo.inference.types import RequestError

    gen_kw = {"failures": [RequestError("prompt too long")]} if fail else None
    cfg = _cfg()
    cfg = replace(cfg, batcher=replace(cfg.batcher, curriculum=True, curriculum_pass=1.0))
    assert isinstance(cfg.batcher, BatcherConfig) and BUDGET

    async def main():
        b, _ = _make(cfg, gen_kw)
        await b.start(0)
        await b.set_version(0)
        rounds = 0
        while not isinstance(item := await b.get(0, 30), EndOfBatch):
            rounds += 1
        while not isinstance(await b.get(1, 30), EndOfBatch):
            pass
        await b.stop()
        return b, item, rounds

    b, eob, rounds = asyncio.run(asyncio.wait_for(main(), 60))
    assert eob.num_minibatches == rounds > 0  # the curriculum's counts leave the books alone
    assert eob.stats["curriculum/prompts_seen"] == 4.0
    assert sum(b.curriculum._results[0][i][2] for i in range(4)) == 16  # 4 groups of 4
    assert {r[0] for r in b.curriculum._results[0]} == set(b.curriculum.draw(0, 4))
    assert sum(r[1] == 0 and r[2] == 4 for r in b.curriculum._results[0]) >= fail


def test_draws_are_those_of_random_choices_to_the_bit():
    """The numpy draw picks exactly what `rng.choices(range(n), weights)` over the Python
    weights picked (the draws a run resumed from an older checkpoint expects)."""
    import random

    rng = random.Random(5)
    for n, k in [(1, 3), (7, 14), (3, 11), (50, 12), (3000, 64)]:  # 3 and 11: rounds over
        cur = Curriculum(n, seed=n, lag=0, floor=0.05)
        for i in range(n):
            cur.samples[i] = rng.choice([0, 0, 1, 8, 16, 100])
            cur.passes[i] = rng.randint(0, cur.samples[i])
        cur.folded_through = 10**9  # nothing left to fold
        want, draws = [], random.Random(f"{n}:curriculum:3")
        weights = [cur.weight(i) for i in range(n)]
        for _ in range(k):
            if want and len(want) % n == 0:
                weights = [cur.weight(i) for i in range(n)]
            i = draws.choices(range(n), weights)[0]
            want.append(i)
            weights[i] = 0.0
        assert cur.draw(3, k) == want


def test_a_step_drawing_several_rounds_of_prompts_draws_each_once_a_round():
    """More draws than twice the prompts (a step of 8 questions over 3 prompts): each
    round of n draws holds every prompt once, and the last partial round distinct ones."""
    cur = Curriculum(3, seed=0, lag=0)
    picks = cur.draw(0, 8)
    assert [sorted(picks[i : i + 3]) for i in (0, 3)] == [[0, 1, 2], [0, 1, 2]]
    assert len(set(picks[6:])) == 2
