"""WeightPusher (trainer rank 0): full weights -> every generation worker, versioned.

The weight-sync group is (re)formed whenever the set of registered workers changes, so a
worker that joins mid-run is in the next broadcast; before that it loads the weights
published in the registry (a Ray object the registry owns, so it outlives this run).
Tensors travel in the dtype the workers serve (each resolves `auto` on its own node);
workers that disagree get fp32 and cast on load.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import torch

from async_grpo.weight_sync import WeightSyncGroup, metas_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class WeightPusher:
    def __init__(
        self,
        pools: list[str],
        backend: str,
        timeout_s: float = 300.0,
        publish: bool = True,
    ) -> None:
        from async_grpo.inference.client import get_registry

        self.registries = {p: get_registry(p) for p in pools}
        self.backend, self.timeout_s, self.publish = backend, timeout_s, publish
        self.dtype = torch.float32
        self.worker_dtypes: dict[str, str] = {}
        self.group: WeightSyncGroup | None = None
        self.members: dict[str, Any] = {}
        self.last: dict[str, float] = {}

    def _current_workers(self) -> dict[str, Any]:
        import ray

        handles: dict[str, Any] = {}
        for reg in self.registries.values():
            handles |= ray.get(reg.handles.remote(), timeout=60)
        return handles

    def _form_group(self, handles: dict[str, Any]) -> None:
        import ray

        if self.group is not None:
            self.group.close()
        sizes = ray.get([h.group_size.remote() for h in handles.values()], timeout=60)
        pings = ray.get([h.ping.remote() for h in handles.values()], timeout=60)
        self.worker_dtypes = {p["worker_id"]: p["dtype"] for p in pings}
        served = set(self.worker_dtypes.values())
        self.dtype = getattr(torch, served.pop() if len(served) == 1 else "float32")
        world = 1 + sum(sizes)
        host = ray.util.get_node_ip_address()
        port = _free_port()
        refs, offset = {}, 1
        for (wid, h), size in zip(handles.items(), sizes, strict=True):
            refs[wid] = h.init_weight_sync.remote(
                host, port, offset, world, self.backend, self.timeout_s
            )
            offset += size
        self.group = WeightSyncGroup(host, port, 0, world, self.backend, self.timeout_s)
        self._wait(refs, "join the weight-sync group")
        self.members = handles

    @property
    def wire_dtype(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def _wait(self, refs: dict[str, Any], what: str) -> list[Any]:
        import ray

        ready, pending = ray.wait(
            list(refs.values()), num_returns=len(refs), timeout=self.timeout_s
        )
        if pending:
            late = [wid for wid, r in refs.items() if r in pending]
            raise TimeoutError(f"workers {late} did not {what} within {self.timeout_s:.0f}s")
        return ray.get(ready)

    def _publish(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Keep `version` in each registry for late joiners. A registry copies the object
        into one it owns: ours dies with this process, theirs outlives the run."""
        import ray
        from ray.exceptions import GetTimeoutError

        ref = ray.put({k: v.to(self.dtype) for k, v in state.items()})
        refs = [reg.publish_weights.remote(version, [ref]) for reg in self.registries.values()]
        try:
            ray.get(refs, timeout=self.timeout_s)
        except GetTimeoutError:
            raise TimeoutError(
                f"registries {list(self.registries)} did not keep weights version {version}"
                f" within {self.timeout_s:.0f}s"
            ) from None

    def push(self, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Broadcast `state` as `version`; returns timings (seconds) and bytes."""

        t0 = time.perf_counter()
        handles = self._current_workers()
        if not handles:
            raise RuntimeError(f"no workers registered in {list(self.registries)} to push to")
        if set(handles) != set(self.members):
            self._form_group(handles)
        t1 = time.perf_counter()
        named = list(state.items())
        metas = metas_for(named, self.dtype)
        wire = [(m.name, m.shape, m.dtype) for m in metas]
        refs = {wid: h.receive_weights.remote(wire, version) for wid, h in self.members.items()}
        sent = self.group.send(named, metas)
        versions = self._wait(refs, f"load weights version {version}")
        t2 = time.perf_counter()
        if self.publish:
            self._publish(state, version)
        t3 = time.perf_counter()
        self.last = {
            "time/weight_push": t2 - t1,
            "time/weight_group": t1 - t0,
            "time/weight_publish": t3 - t2,
            "weight_push_bytes": float(sent),
            "worker_version/min": float(min(versions)),
        }
        return self.last
