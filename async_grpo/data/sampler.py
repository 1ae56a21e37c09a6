"""A seeded, resumable prompt order: a fresh permutation per epoch, position in the state."""

from __future__ import annotations

import random
from typing import Any


class PromptSampler:
    """Yields prompt indices forever; `state_dict()` / `load_state_dict()` resume exactly."""

    def __init__(self, num_prompts: int, seed: int) -> None:
        if num_prompts <= 0:
            raise ValueError(f"num_prompts must be > 0, got {num_prompts}")
        self.num_prompts = num_prompts
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)
        self._other: tuple[int, list[int]] = (-1, [])  # index_at's epoch other than `epoch`

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.num_prompts))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next(self) -> int:
        if self.position == self.num_prompts:
            self.epoch += 1
            self.position = 0
            self._order = self._permutation(self.epoch)
        index = self._order[self.position]
        self.position += 1
        return index

    def index_at(self, draw: int) -> int:
        """The prompt index of global draw number `draw` (0-based), without moving the
        sampler: draw k is position k % n of epoch k // n. Stateless, so exact to resume."""
        epoch, position = divmod(draw, self.num_prompts)
        if epoch == self.epoch:
            return self._order[position]
        if self._other[0] != epoch:  # one permutation kept: draws come epoch by epoch
            self._other = (epoch, self._permutation(epoch))
        return self._other[1][position]

    def take(self, k: int) -> list[int]:
        return [self.next() for _ in range(k)]

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_prompts": self.num_prompts,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_prompts"] != self.num_prompts or state["seed"] != self.seed:
            raise ValueError(
                f"sampler state is for {state['num_prompts']} prompts / seed {state['seed']},"
                f" not {self.num_prompts} / {self.seed}"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
