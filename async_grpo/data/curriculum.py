"""Curriculum: prompts drawn by measured mastery instead of in a fixed shuffled order.

Each prompt's mastery is its pass rate over the groups generated for it so far, smoothed
towards 1/2 for prompts seen rarely: m = (passes + 1) / (samples + 2). A prompt is drawn
with weight `floor + 4 m (1 - m)`: 1 + floor for an unseen or half-solved prompt, `floor`
for one always or never solved, so the steps go where the groups have mixed rewards (the
only groups GRPO learns from).

Exact resume: the draws of step s use the results of steps <= s - lag - 1 only (the steps
already trained when step s may start under the fixed lag), folded in step order, and a
random generator seeded by (seed, step). So a run draws the same prompts whenever it was
interrupted; the checkpoint keeps the folded table (`state_dict`).
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from typing import Any

import numpy as np


class Curriculum:
    """Mastery per prompt index; `draw(step, k)` -> k distinct prompt indices."""

    def __init__(self, num_prompts: int, seed: int, lag: int, floor: float = 0.1) -> None:
        if num_prompts <= 0 or floor <= 0:
            raise ValueError(f"need num_prompts > 0 and floor > 0, got {num_prompts}, {floor}")
        self.num_prompts, self.seed, self.lag, self.floor = num_prompts, seed, lag, floor
        self.samples = [0] * num_prompts  # over the folded steps
        self.passes = [0] * num_prompts
        self.folded_through = -1  # the last step whose results are in the table
        self._results: dict[int, list[tuple[int, int, int]]] = defaultdict(list)

    def record(self, step: int, index: int, passes: int, samples: int) -> None:
        """Step `step`'s group of prompt `index` had `passes` of `samples` passing."""
        if step > self.folded_through:  # a replayed step already in the table is not counted twice
            self._results[step].append((index, passes, samples))

    def record_groups(self, step: int, groups: list[list[Any]], passing: float) -> None:
        """Each group of `step` drawn from the prompts (a sample's `prompt_index` >= 0): how
        many of its first turns (`continues` False) scored `passing` or more."""
        for group in (g for g in groups if g[0].prompt_index >= 0):
            heads = [s for s in group if not s.continues]
            passed = sum(s.reward >= passing for s in heads)
            self.record(step, group[0].prompt_index, passed, len(heads))

    def mastery(self, index: int) -> float:
        return (self.passes[index] + 1) / (self.samples[index] + 2)

    def weight(self, index: int) -> float:
        m = self.mastery(index)
        return self.floor + 4 * m * (1 - m)

    def draw(self, step: int, k: int) -> list[int]:
        """The k prompts of step `step`, distinct while k <= num_prompts.

        Each pick is `rng.choices(range(n), weights)` done with numpy, to the bit: the same
        float64 weights, their running sum added in order, and `bisect_right` of
        `random() * total` over all but the last sum; O(n) in C per pick, not in Python."""
        self._fold(step - self.lag - 1)
        rng = random.Random(f"{self.seed}:curriculum:{step}")
        weights = self._weights()
        chosen: list[int] = []
        for _ in range(k):
            if chosen and len(chosen) % self.num_prompts == 0:  # every prompt drawn: again
                weights = self._weights()
            cum = np.cumsum(weights)
            total = float(cum[-1]) + 0.0
            if not (total > 0.0 and math.isfinite(total)):
                raise ValueError(f"curriculum weights sum to {total}")
            i = int(np.searchsorted(cum[:-1], rng.random() * total, side="right"))
            chosen.append(i)
            weights[i] = 0.0
        return chosen

    def _weights(self) -> np.ndarray:
        """`weight(i)` of every prompt, in float64 with the same operations in the same order."""
        m = (np.asarray(self.passes, dtype=np.float64) + 1) / (
            np.asarray(self.samples, dtype=np.float64) + 2
        )
        return self.floor + 4 * m * (1 - m)

    def _fold(self, through: int) -> None:
        for step in sorted(s for s in self._results if s <= through):
            for index, passes, samples in self._results.pop(step):
                self.passes[index] += passes
                self.samples[index] += samples
        self.folded_through = max(self.folded_through, through)

    def stats(self) -> dict[str, float]:
        """Over the prompts seen so far (every recorded group, trained or not): how many,
        and the shares mastered (m > 0.9) and unsolved (m < 0.1)."""
        samples = np.asarray(self.samples, dtype=np.int64)
        passes = np.asarray(self.passes, dtype=np.int64)
        for results in self._results.values():
            for index, p, n in results:
                samples[index] += n
                passes[index] += p
        seen = samples > 0
        if not seen.any():
            return {"curriculum/prompts_seen": 0.0}
        mastery = (passes[seen] + 1) / (samples[seen] + 2)
        return {
            "curriculum/prompts_seen": float(seen.sum()),
            "curriculum/mastered_fraction": float((mastery > 0.9).sum() / len(mastery)),
            "curriculum/unsolved_fraction": float((mastery < 0.1).sum() / len(mastery)),
        }

    def state_dict(self, through: int) -> dict[str, Any]:
        """The table with the results of steps <= `through` folded in (a checkpoint after
        step `through`: every later draw folds at least that far)."""
        self._fold(through)
        seen = {
            i: [self.samples[i], self.passes[i]] for i in range(self.num_prompts) if self.samples[i]
        }
        return {"num_prompts": self.num_prompts, "through": through, "table": seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_prompts"] != self.num_prompts:
            raise ValueError(
                f"curriculum state is for {state['num_prompts']} prompts, not {self.num_prompts}"
            )
        for i, (samples, passes) in state["table"].items():
            self.samples[int(i)], self.passes[int(i)] = samples, passes
        self.folded_through = state["through"]
