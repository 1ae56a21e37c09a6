"""Token-budgeted rounds: one minibatch per trainer rank, filled first-fit-decreasing.

A round is emitted while the batch is still being generated, as soon as every rank's bin
is filled to `min_fill` of the budget; the rest of the batch goes out at its end through
`plan_minibatches`, which pads ranks with empty minibatches so all ranks run the same
number of forward/backward passes.
"""

from __future__ import annotations

from async_grpo.batcher.types import ScoredSample
from async_grpo.core.packing import packed_length, packed_tokens, plan_minibatches

FILL_TARGET = 0.95


def group_units(
    group: list[ScoredSample], budget: int, share_prompts: bool
) -> list[list[ScoredSample]]:
    """`group` cut into packing units (`split_group`): samples that share one row."""
    lens = [len(s.completion_ids) for s in group]
    units = split_group(len(group[0].prompt_ids), lens, budget, share_prompts)
    return [[group[i] for i in unit] for unit in units]


def split_group(
    prompt_len: int, completion_lens: list[int], budget: int, share_prompts: bool
) -> list[list[int]]:
    """A group's samples (by index) as packing units: one sample each without sharing; with
    sharing, consecutive runs whose shared row (`packed_length`) fits the budget."""
    if not share_prompts:
        return [[i] for i in range(len(completion_lens))]
    units: list[list[int]] = []
    for i, n in enumerate(completion_lens):
        if (
            units
            and packed_length(prompt_len, [completion_lens[j] for j in units[-1]] + [n], True)
            <= budget
        ):
            units[-1].append(i)
        else:
            units.append([i])
    return units


def fill_round(
    lengths: list[int], num_ranks: int, budget: int, min_fill: float = FILL_TARGET
) -> list[list[int]] | None:
    """Indices for one minibatch per rank, each bin <= `budget` and >= `min_fill * budget`
    tokens; None when the samples at hand cannot fill every bin yet."""
    for i, n in enumerate(lengths):
        if n > budget:
            raise ValueError(f"sample {i} has {n} tokens, above the budget of {budget}")
    bins: list[list[int]] = [[] for _ in range(num_ranks)]
    room = [budget] * num_ranks
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        # best fit: the bin with the least room that still takes the sample
        fits = [r for r in range(num_ranks) if room[r] >= lengths[i]]
        if fits:
            r = min(fits, key=room.__getitem__)
            bins[r].append(i)
            room[r] -= lengths[i]
    if all(budget - left >= min_fill * budget for left in room):
        return bins
    return None


def flat_units(units: list[list[ScoredSample]], picked: list[int]) -> list[ScoredSample]:
    """The samples of the picked units, each unit's samples kept together."""
    return [s for i in picked for s in units[i]]


def plan_parts(
    groups: list[list[ScoredSample]], parts: int, budget: int, share_prompts: bool, ranks: int
) -> list[tuple[list[list[ScoredSample]], list[list[list[int]]]]]:
    """`groups` (in the order given) cut into `parts` contiguous parts of whole groups, each
    as its packing units and its own `plan_minibatches` over `ranks`: one optimizer update
    per part (`trainer.mini_batches`)."""
    out = []
    for m in range(parts):
        part = groups[m * len(groups) // parts : (m + 1) * len(groups) // parts]
        units = [u for g in part for u in group_units(g, budget, share_prompts)]
        lengths = [packed_tokens(u, share_prompts) for u in units]
        out.append((units, plan_minibatches(lengths, budget, ranks)))
    return out
