"""WeightPusher: the policy's weights -> every generation worker, versioned, streamed.

Every trainer rank holds one and calls `push` (a collective): the parameters are gathered
from their FSDP shards one at a time, in order, on the trainer's device. Rank 0 casts
each into one of two reused slots (a chunk of whole layers per slot) and announces the
chunk to the workers while it fills the other slot, so no rank ever holds more than two
chunks beyond its shards, and rank 0 never builds a copy of the model.

Each worker gets the chunks by the transport `transports.select.choose_transport` picked
for it (shared memory or CUDA IPC where it shares the trainer's node or GPU, a broadcast
group elsewhere), all in one push. The set of workers is re-read every push: a worker
that joined since is connected then (until then it serves the newest checkpoint, see
registry.announce_checkpoint). A worker that dies during a push is dropped from its
registry and the push goes on without it; if it was in the broadcast group, the group is
broken, so it is formed again without it and the push is sent again from the start (the
survivors stay paused in between). Nothing is put in the Ray object store.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import torch
from torch import nn

from async_grpo.transports.base import CHUNK_BYTES, TensorMeta, plan_chunks, slot_bytes, view_at


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class GroupBroken(RuntimeError):
    """A member of the broadcast group died during a push."""


def rank0_decides(flag: bool) -> bool:
    """Rank 0's `flag`, on every rank (a collective; the other ranks' `flag` is ignored)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    t = torch.tensor([int(flag)])  # host tensor: the default group carries cpu tensors
    dist.broadcast(t, src=0)
    return bool(t.item())


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter (an all-gather across ranks for an FSDP shard)."""
    full = getattr(param, "full_tensor", None)
    return full() if callable(full) else param


class WeightPusher:
    def __init__(
        self,
        policy: nn.Module,
        rank: int,
        device: str = "cpu",
        transport: str = "auto",
        pools: tuple[str, ...] = ("generation",),
        timeout_s: float = 300.0,
        chunk_limit: int = CHUNK_BYTES,
        worker_wait_s: float = 600.0,
        in_flight: bool = False,
    ) -> None:
        from async_grpo.trainer.payloads import select_payload

        # what is gathered (every rank, in order) and what goes on the wire
        self.payload = select_payload(policy)
        self.params, self.wire = self.payload.params, self.payload.wire
        self.adapter_config: dict[str, Any] = getattr(policy, "adapter_config", {})
        self._parts: tuple[int, dict[str | None, torch.Tensor]] = (-1, {})
        self.rank, self.device, self.forced = rank, device, transport
        self.timeout_s, self.chunk_limit, self.worker_wait_s = timeout_s, chunk_limit, worker_wait_s
        self.in_flight = in_flight  # running requests continue on the new weights
        self.registries: dict[str, Any] = {}
        self.pool_of: dict[str, str] = {}  # worker id -> pool
        self.lost: list[str] = []  # workers that died during pushes (a metric)
        self.attempt = 0  # pushes sent, retries included: stale chunk calls are told apart
        if rank == 0:
            from async_grpo.inference.client import get_registry

            self.registries = {p: get_registry(p) for p in pools}
        self.dtype = torch.float32
        self.worker_dtypes: dict[str, str] = {}
        self.transports: dict[str, str] = {}  # worker id -> transport
        self.members: dict[str, Any] = {}
        self.metas: list[TensorMeta] = []
        self.chunks: list[list[int]] = []
        self.slots: Any = None
        self.group: Any = None
        self.last: dict[str, float] = {}
        self._gathered = 0  # parameters gathered so far in this push attempt (in order)
        self.pack_s = 0.0  # rank 0's share of the last stream: gathering and casting

    @property
    def wire_dtype(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def push(self, version: int) -> dict[str, float]:
        """Send the current weights as `version` (every rank calls this); rank 0 returns
        timings (seconds), bytes and the transports used, the other ranks {}."""
        if self.rank != 0:
            while True:
                for _, p in self.params:  # take part in every gather, in rank 0's order
                    _full(p)
                if not rank0_decides(False):
                    return {}
        t0 = time.perf_counter()
        for tries_left in (1, 0):
            self._gathered = 0
            self._parts = (-1, {})
            try:
                t1, t2, sent, versions, drains = self._push_once(version)
            except GroupBroken as e:  # the survivors are paused mid-update: send it again
                if not tries_left:
                    raise
                print(f"weight push {version}: {e}; forming the group again, resending", flush=True)
                for _, p in self.params[self._gathered :]:  # the other ranks gather them all
                    _full(p)
                self.close()
                rank0_decides(True)
                continue
            rank0_decides(False)
            break
        t3 = time.perf_counter()
        self.last = {
            "time/weight_push": t3 - t1,
            "time/weight_connect": t1 - t0,
            "time/weight_drain": t2 - t1,
            "time/weight_stream": t3 - t2,
            "time/weight_pack": self.pack_s,
            "weight_push_bytes": float(sent),
            "worker_version/min": float(min((v["version"] for v in versions), default=-1)),
            "worker_prefix_reset_failures": float(
                sum(v["prefix_reset_failures"] for v in versions)
            ),
            "worker_weight_load_failures": float(sum(v["weight_load_failures"] for v in versions)),
            "worker_drain_s/max": float(max(drains, default=0.0)),
            "weight_push_lost_workers": float(len(self.lost)),
        }
        for kind in ("broadcast", "shm", "cuda_ipc"):
            self.last[f"weight_transport/{kind}"] = float(
                sum(k == kind for k in self.transports.values())
            )
        return self.last

    def _push_once(self, version: int) -> tuple[float, float, int, list[Any], list[Any]]:
        """Connect (if the workers changed), pause, stream, finish; GroupBroken if a
        broadcast member died on the way."""
        handles = self._live_workers()
        if set(handles) != set(self.members):
            self._connect(handles)
        self.attempt += 1
        t1 = time.perf_counter()
        drains = self._wait(
            {
                w: h.begin_update.remote(version, self.timeout_s, self.attempt, self.in_flight)
                for w, h in self.members.items()
            },
            f"pause for weights version {version}",
        )
        t2 = time.perf_counter()
        sent = self._stream()
        versions = self._wait(
            {w: h.end_update.remote(version) for w, h in self.members.items()},
            f"finish loading weights version {version}",
        )
        return t1, t2, sent, list(versions.values()), list(drains.values())

    def _stream(self) -> int:
        """Rank 0: gather, cast and announce every chunk, two slots in turn; bytes sent."""
        in_slot: list[tuple[dict[str, Any], Any, int] | None] = [None, None]
        sent = 0
        self.pack_s = 0.0
        for k, chunk in enumerate(self.chunks):
            s = k % 2
            if in_slot[s] is not None:  # every worker has loaded chunk k-2 from slot s
                self._drain_slot(in_slot, s)
            tp = time.perf_counter()
            slot = self.slots.slot(s)
            offset = 0
            for i in chunk:
                dst, offset = view_at(slot, offset, self.metas[i])
                dst.copy_(self._wire_tensor(i))
            if self.device == "cuda":
                torch.cuda.current_stream().synchronize()  # complete before others read it
            self.pack_s += time.perf_counter() - tp
            metas = [(m.name, list(m.shape), m.dtype) for m in (self.metas[i] for i in chunk)]
            refs = {
                w: h.load_chunk.remote(k, metas, s, offset, self.attempt)
                for w, h in self.members.items()
            }
            in_slot[s] = (
                refs,
                self.group.broadcast(slot[:offset]) if self.group is not None else None,
                k,
            )
            sent += offset
        for s in sorted((s for s in (0, 1) if in_slot[s] is not None), key=lambda s: in_slot[s][2]):
            self._drain_slot(in_slot, s)
        return sent

    def _wire_tensor(self, i: int) -> torch.Tensor:
        """Wire tensor `i`, built from its source parameters gathered (once, in order:
        every rank gathers the same parameters in the same order)."""
        _, _, index, part = self.wire[i]
        if self._parts[0] != index:
            n = self.payload.sources[index]
            fulls = [_full(p).detach() for _, p in self.params[index : index + n]]
            self._gathered = index + n
            self._parts = (index, self.payload.build(index, fulls))
        return self._parts[1][part]

    def _drain_slot(self, in_slot: list[tuple[dict[str, Any], Any, int] | None], s: int) -> None:
        """Wait until every worker has loaded the chunk in slot `s`, then free the slot.

        When its broadcast fails (a member died), the group is torn down before anything
        else: a member blocked receiving from rank 0 waits for the group's timeout unless
        rank 0's connections close, and they close only when the last reference to the
        group and to its pending broadcasts is gone. Then the dead are found among the
        chunk's loads, and GroupBroken is raised. The same happens when rank 0's broadcast
        completed but a member died before loading: gloo may relay the bytes through that
        member, so the others could be left waiting for them."""
        refs, work, k = in_slot[s]
        in_slot[s] = None
        if work is None:
            self._wait(refs, f"load weight chunk {k}")
            return
        try:
            work.wait()
            failed = None
        except RuntimeError as e:  # a peer's connection closed: it died
            failed = f"the broadcast of chunk {k} failed ({e})"
        del work
        if failed is None:
            try:
                self._wait(refs, f"load weight chunk {k}", stop_on_broken=True)
                return
            except GroupBroken as e:  # rank 0's sends went out, but a member that relays
                failed = str(e)  # them to others died: they wait until the group closes
        in_slot[:] = [None, None]  # the other slot's broadcast, if any, goes too
        self.group.close()
        self.group = None
        alive = {w: r for w, r in refs.items() if w not in self.lost}
        # who it was. A member whose receive the teardown did not end fails at its own group
        # timeout (timeout_s, from when it began to receive): outwait that, or give up on the
        # whole push moments before the member would have come back
        self._wait(alive, f"load weight chunk {k}", allow_lost=True, timeout_s=self.timeout_s + 30)
        raise GroupBroken(failed)

    def _live_workers(self) -> dict[str, Any]:
        """The registered workers that answer; a dead one is dropped from its registry (it
        may be restarting). With none, wait up to `worker_wait_s` for one to register."""
        import ray
        from ray.exceptions import GetTimeoutError

        from async_grpo.ray_utils import gone_errors

        deadline = time.monotonic() + self.worker_wait_s
        while True:
            live: dict[str, Any] = {}
            for pool, reg in self.registries.items():
                for wid, h in ray.get(reg.handles.remote(), timeout=60).items():
                    try:
                        ray.get(h.ping.remote(), timeout=60)
                    except gone_errors():  # dead, or on a lost node
                        ray.get(reg.drop.remote(wid, "dead at a weight push"), timeout=60)
                        continue
                    except GetTimeoutError:
                        pass  # alive but slow to answer: it joins the push
                    live[wid] = h
                    self.pool_of[wid] = pool
            if live:
                return live
            if time.monotonic() > deadline:
                lost = {}
                for reg in self.registries.values():
                    lost |= ray.get(reg.lost.remote(), timeout=60)
                gone = "; ".join(f"{w}: {why}" for w, why in lost.items()) or "none"
                raise TimeoutError(
                    f"no live workers in pool(s) {list(self.registries)} to push to for"
                    f" {self.worker_wait_s:.0f}s (dropped: {gone}); start some"
                    " (async-grpo worker --mode generation)"
                )
            time.sleep(2.0)

    def _connect(self, handles: dict[str, Any]) -> None:
        """Choose each worker's transport, size the slots, open every worker's end."""
        import ray

        from async_grpo.transports.select import Place, choose_transport, make_slots

        self.close()
        pings = self._wait({w: h.ping.remote() for w, h in handles.items()}, "answer a ping")
        places = self._wait({w: h.place.remote() for w, h in handles.items()}, "report place")
        sizes = self._wait({w: h.group_size.remote() for w, h in handles.items()}, "size")
        handles = {w: h for w, h in handles.items() if w in sizes}  # the dead are left out
        self.worker_dtypes = {p["worker_id"]: p["dtype"] for p in pings.values()}
        served = set(self.worker_dtypes.values())
        self.dtype = getattr(torch, served.pop() if len(served) == 1 else "float32")
        self.metas = [TensorMeta(n, shape, self.wire_dtype) for n, shape, _, _ in self.wire]
        self.chunks = plan_chunks(self.metas, self.chunk_limit)
        here = Place(ray.get_runtime_context().get_node_id(), self._device_id())
        self.transports = {
            w: choose_transport(self.forced, here, Place(*places[w]))[0] for w in handles
        }
        size = slot_bytes(self.metas, self.chunks)
        self.slots = make_slots(set(self.transports.values()), size, self.device)
        infos = self._infos(handles, [sizes[w] for w in handles], size)
        refs = {w: handles[w].init_weight_transfer.remote(info) for w, info in infos.items()}
        if any(k == "broadcast" for k in self.transports.values()):
            from async_grpo.transports.broadcast import WeightSyncGroup

            b = next(i for i in infos.values() if i["kind"] == "broadcast")
            backend = b["backend"]
            self.group = WeightSyncGroup(
                b["host"], b["port"], 0, b["world_size"], backend, self.timeout_s
            )
        self.members = dict(handles)
        self._wait(refs, "open their weight transport")

    def _infos(
        self, handles: dict[str, Any], sizes: list[int], slot_bytes: int
    ) -> dict[str, dict[str, Any]]:
        """Each worker's init info: broadcast ranks 1.. in worker order, TP shards apart."""
        import ray

        host, port = ray.util.get_node_ip_address(), _free_port()
        remote = [
            (w, n) for w, n in zip(handles, sizes, strict=True) if self.transports[w] == "broadcast"
        ]
        world = 1 + sum(n for _, n in remote)
        infos, offset = {}, 1
        for w, n in remote:
            infos[w] = {
                "kind": "broadcast",
                "host": host,
                "port": port,
                "rank_offset": offset,
                "world_size": world,
                "backend": "nccl" if self.device == "cuda" else "gloo",
                "timeout_s": self.timeout_s,
                "slot_bytes": slot_bytes,
            }
            offset += n
        for w in handles:
            if self.transports[w] != "broadcast":
                infos[w] = {"kind": self.transports[w], **self.slots.worker_info()}
        for info in infos.values():  # what the chunks hold: the weights, or an adapter
            info["payload"] = self.payload.kind.name
            info["adapter_config"] = self.adapter_config
        return infos

    def _device_id(self) -> str:
        if self.device == "cpu":
            return "cpu"
        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)

    def _wait(
        self,
        refs: dict[str, Any],
        what: str,
        allow_lost: bool = False,
        stop_on_broken: bool = False,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Each worker's answer within `timeout_s` (default: the push's); a worker that died
        meanwhile is dropped (`_lose`) and has none. GroupBroken if it was in the broadcast
        group (unless `allow_lost`): at once, without waiting for the others, with
        `stop_on_broken`."""
        import ray
        from ray.exceptions import RayTaskError

        from async_grpo.ray_utils import gone_errors

        owner = {ref: wid for wid, ref in refs.items()}
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        pending, deadline = list(refs.values()), time.monotonic() + timeout_s
        answers, broken = {}, []
        while pending:
            left = max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                late = [owner[r] for r in pending]
                raise TimeoutError(f"workers {late} did not {what} within {timeout_s:.0f}s")
            (ref,) = ready
            wid = owner[ref]
            try:
                answers[wid] = ray.get(ref)
            except gone_errors():  # dead, or on a lost node
                if self._lose(wid, what) == "broadcast":
                    broken.append(wid)
            except RayTaskError:
                if not allow_lost:
                    raise
                # a survivor of a broken group: its receive failed with the group; it is
                # paused mid-update and takes the push again
            if broken and stop_on_broken and not allow_lost:
                break
        if broken and not allow_lost:
            raise GroupBroken(f"broadcast member(s) {broken} died while asked to {what}")
        return answers

    def _lose(self, wid: str, what: str) -> str | None:
        """Drop a worker that died during a push; returns the transport it had."""
        import ray

        print(
            f"weight push: worker {wid} died while asked to {what}; going on without it",
            flush=True,
        )
        self.lost.append(wid)
        self.members.pop(wid, None)
        pool = self.pool_of.get(wid)
        if pool is not None:
            reason = f"died during a weight push ({what})"
            ray.get(self.registries[pool].drop.remote(wid, reason), timeout=60)
        return self.transports.pop(wid, None)

    def behind(self, version: int) -> list[str]:
        """Rank 0: the registered workers that serve a version older than `version`."""
        import ray

        stats = ray.get([r.status.remote() for r in self.registries.values()], timeout=60)
        return [w.worker_id for pool in stats for w in pool if w.version < version]

    def announce_checkpoint(self, version: int, hf_dir: str | None) -> None:
        """Rank 0: workers that join from now on load this checkpoint before serving
        (None: no checkpoint of this run yet)."""
        import ray

        refs = [r.announce_checkpoint.remote(version, hf_dir) for r in self.registries.values()]
        ray.get(refs, timeout=60)

    def remove_weight_file(self) -> None:
        """Unlink the shared-memory slots' file (a run that fails: nothing else is closed)."""
        if self.slots is not None:
            self.slots.close()
            self.slots = None

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.remove_weight_file()
        self.members = {}
