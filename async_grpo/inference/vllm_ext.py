"""Methods mixed into vLLM's worker (`worker_extension_cls`), called via `collective_rpc`.

They run inside the engine's worker process, once per tensor-parallel shard: each shard is
its own member of the weight-sync group, receives the full tensors, and lets vLLM's
`reload_weights` shard and repack them (on CPU vLLM repacks linear weights, so a plain
`load_weights` into the live model fails).
"""

from __future__ import annotations

from typing import Any

from async_grpo.weight_sync import TensorMeta, WeightSyncGroup


class WeightSyncExtension:
    """`self` is vLLM's worker at run time."""

    def async_grpo_init_sync(
        self,
        host: str,
        port: int,
        rank_offset: int,
        world_size: int,
        backend: str,
        timeout_s: float,
    ) -> int:
        old = getattr(self, "_async_grpo_group", None)
        if old is not None:
            old.close()
        rank = rank_offset + self._async_grpo_tp_rank()
        self._async_grpo_group = WeightSyncGroup(host, port, rank, world_size, backend, timeout_s)
        return rank

    def async_grpo_receive(self, metas: list[tuple[str, tuple[int, ...], str]]) -> int:
        """Receive one broadcast of the full weights and load them; returns tensors loaded."""
        group = self._async_grpo_group
        pairs = list(group.recv([TensorMeta(n, tuple(s), d) for n, s, d in metas]))
        self.reload_weights(weights_iterator=iter(pairs))
        return len(pairs)

    def async_grpo_close_sync(self) -> None:
        group = getattr(self, "_async_grpo_group", None)
        if group is not None:
            group.close()
            self._async_grpo_group = None

    def _async_grpo_tp_rank(self) -> int:
        rank: Any = getattr(self, "rank", 0)
        return int(rank)
