"""Groups of fresh prompts in the places of a step's equal-reward groups: spare groups,
started ahead and used if ready (opportunistic), and redraws (DAPO's dynamic sampling),
started once a group comes back equal and waited for. One prompt order serves both.

Spare groups: a few extra groups per step that keep the generation pool working while a
trainer-bound run would leave it idle, and that replace the step's equal-reward groups.

An equal-reward group has all-zero advantages, so with no KL or entropy term it adds
nothing to the gradient (the batcher sets it aside as skipped). With `batcher.spare_groups`
= m, every step also starts m spare groups, drawn from a prompt order of their own and
generated under the same policy version as the step's regular groups (so the staleness
bound holds for them too). When the step is packed, each spare that has already finished
with unequal rewards takes the place of one equal-reward group; the spares still running
are cancelled, and so is every spare still running when the trainer is about to push (or
save): a push never waits for a spare, in the batcher or in the engine; packing waits for them only until a trainer
rank asks for the step's next minibatch, so the trainer waits only for the cancellations.
Which spares are ready depends on timing, so a run with spares is not bit-reproducible; a
resumed run trains a checkpointed step on its groups as they stood at the checkpoint (after
the swap if the step was packed by then; a step not yet packed gets no spares).

The books stay balanced: a spare's samples are requested like any others, and leave as
trained, as `dropped/spare_unused` (finished with equal rewards, surplus, or cancelled), or
as the drop of a failed attempt; a replaced group's samples leave as
`dropped/replaced_by_spare`, and the spare fills its slot.

Redraws (`batcher.dynamic_sampling` = R): a group of slot i that comes back with equal
rewards is replaced, in the same task and so under the same policy version (a push waits
for it like for any group of the step), by a group of a fresh prompt, up to R times per
slot: at most q * R extra groups a step. Redraw a of slot i of step s is draw
(s * q + i) * R + a of the order, with its own sampling seeds, so which prompts replace
which does not depend on timing, and the slot holds the final group before the step is
packed: a checkpoint keeps it, and a resumed run trains the same groups. A replaced
group's samples leave as `dropped/redrawn`; a group still equal after R redraws is set
aside as any equal-reward group. Unlike DAPO, the step keeps the equal groups it could not
replace in its normaliser (their tokens count, as skipped ones do): the objective does not
change with the bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from async_grpo.batcher.types import ScoredSample, rollouts
from async_grpo.config import BatcherConfig
from async_grpo.data import PromptSampler
from async_grpo.deadline import mark_seen

Group = list[ScoredSample]
MAX_WAIT_S = 600.0  # the longest a step's packing waits on its spares


class Spares:
    """The spare-group tasks of the steps being generated, and the swap when one is packed."""

    def __init__(self, cfg: BatcherConfig, num_prompts: int) -> None:
        self.per_step, self.group_size = cfg.spare_groups, cfg.samples_per_question
        self.questions, self.redraws = cfg.questions_per_step, cfg.dynamic_sampling
        # their own prompt orders, so the regular draws stay those of a run without spares
        # or redraws (negative seeds: never one of a user's)
        self.sampler = PromptSampler(num_prompts, -1 - cfg.seed)
        self.redraw_sampler = PromptSampler(num_prompts, -(2**20) - cfg.seed)
        self._tasks: dict[int, list[asyncio.Task]] = {}

    def index(self, step: int, j: int) -> int:
        """The prompt of spare j of `step`: draw step * m + j of the spares' order."""
        return self.sampler.index_at(step * self.per_step + j)

    def redraw_index(self, step: int, slot: int, attempt: int) -> int:
        """The prompt of redraw `attempt` of `slot`: draw (step * q + slot) * R + attempt
        of the redraws' order (after the spares' draws of the same order would collide)."""
        draw = (step * self.questions + slot) * self.redraws + attempt
        return self.redraw_sampler.index_at(draw)

    async def redraw(
        self,
        maker: Any,
        step: int,
        slot: int,
        group: Group | None,
        books: dict[str, float],
        redrawn: list[Group],
    ) -> Group | None:
        """Dynamic sampling: while `group` has equal rewards, up to `dynamic_sampling`
        times, a group of a fresh prompt (one try each, from `maker`, a GroupMaker) takes
        its place; each group replaced goes to `redrawn`."""
        for attempt in range(self.redraws):
            if group is None or any(s.advantage != 0.0 for s in group):
                break
            books["groups/redraws"] += 1
            fresh = await maker.find(
                step,
                self.redraw_slot(slot, attempt),
                self.redraw_index(step, slot, attempt),
                attempts=1,
            )
            if fresh is None:  # a failed try, counted as its drop: the equal group stays
                continue
            books["dropped/redrawn"] += rollouts(group)
            redrawn.append(group)
            group = fresh
        return group

    def redraw_slot(self, slot: int, attempt: int) -> int:
        """The slot number a redraw's sampling seeds come from: past the spares' ones."""
        return self.questions + self.per_step + slot * self.redraws + attempt

    def start(
        self,
        step: int,
        make: Callable[[int], Awaitable[Group | None]],
        books: dict[str, float],
    ) -> list[asyncio.Task]:
        """Start `step`'s spares; `make(j)` makes spare j (one try, counting its own drops).
        Returns the tasks, for the caller to cancel on stop."""

        async def spare(j: int) -> Group | None:
            try:
                return await make(j)
            except asyncio.CancelledError:  # packed before it finished
                books["dropped/spare_unused"] += self.group_size
                raise

        loop = asyncio.get_running_loop()
        self._tasks[step] = [loop.create_task(spare(j)) for j in range(self.per_step)]
        for task in self._tasks[step]:  # `use` raises its error; a stop drops it unlogged
            task.add_done_callback(mark_seen)
        return self._tasks[step]

    async def cancel_running(self) -> None:
        """Cancel every spare still running, and wait until each has counted itself: a
        push in `wait` mode lets the engine finish the requests it runs, so the spares must
        be gone before it (they are opportunistic: packing uses the ones that finished)."""
        running = [t for tasks in self._tasks.values() for t in tasks if not t.done()]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)

    async def use(
        self,
        step: int,
        set_aside: list[Group],
        books: dict[str, float],
        slots: dict[int, Group | None],
        needed: Callable[[], Awaitable[None]],
        max_wait_s: float = MAX_WAIT_S,
    ) -> tuple[list[Group], list[Group]]:
        """Swap `step`'s equal-reward groups (`set_aside`) for its spares that finished with
        unequal rewards, in spare order. When there is something to replace, the spares
        still running get until `needed()` returns (a trainer rank is waiting for the
        step's next minibatch) or they all finish; those still running then are cancelled
        and waited for until they have counted themselves. `slots` (the step's groups by
        slot, what a checkpoint keeps) follows the swap. Returns the replaced groups and the
        spares in their places."""
        tasks = self._tasks.get(step, [])  # kept until packed: `cancel_running` sees them
        running = [t for t in tasks if not t.done()]
        if running and set_aside:
            await _first_of(asyncio.wait(running), needed(), max_wait_s)
            running = [t for t in tasks if not t.done()]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)
        self._tasks.pop(step, None)
        ready: list[Group] = []
        for task in tasks:
            if task.cancelled():
                continue  # counted by the spare itself
            group = task.result()  # a spare's unexpected error fails the run, as a group's does
            if group is None:  # a failed try: its drop is counted already
                continue
            unequal = any(s.advantage != 0.0 for s in group)
            if task in running or not unequal or len(ready) == len(set_aside):
                books["dropped/spare_unused"] += rollouts(group)
            else:
                ready.append(group)
        replaced = set_aside[: len(ready)]
        for old, new in zip(replaced, ready, strict=True):
            books["dropped/replaced_by_spare"] += len(old)
            slot = next(k for k, g in slots.items() if g is old)
            slots[slot] = new
        return replaced, ready


async def _first_of(a: Awaitable[object], b: Awaitable[object], timeout_s: float) -> None:
    """Wait until `a` or `b` is done, or `timeout_s` has passed; cancel what is left."""
    pending = {asyncio.ensure_future(a), asyncio.ensure_future(b)}
    try:
        await asyncio.wait(pending, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in pending:
            task.cancel()
            task.add_done_callback(mark_seen)
