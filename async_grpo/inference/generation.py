"""GenerationWorker: one vLLM V1 `AsyncLLM` engine behind a Ray actor.

In: prompt token ids, a group size n, sampling settings; new weights, chunk by chunk,
through vLLM's weight-transfer API (our engine in vllm_ext.py), or a checkpoint folder.
Out: `Completion`s with per-token sampling log-probs and the policy version. Many requests
run at once (continuous batching).

Version rule: an update first pauses the engine until the requests it runs have finished
(vLLM's `pause_generation(mode="wait")`) and clears the KV and prefix caches, so no token
is ever computed from KV of other weights. vLLM labels every output token with the weight
version that sampled it; a completion carries that version (the oldest, should a request
ever span two).

A worker never outlives its engine: when vLLM's engine-core process dies (the OOM killer's
likely choice on CPU) or a push stops arriving mid-update, the actor ends its own process.
Its callers then see a dead worker, the case every pool path handles (requests retried
elsewhere, the worker dropped from a push, a replacement started by `async-grpo run`).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

from async_grpo.config import GenerationConfig
from async_grpo.faults import fault_point
from async_grpo.inference.adapter_versions import AdapterVersions
from async_grpo.inference.engine_args import (
    cpu_kv_cache_args,
    cpu_scheduler_args,
    forked_engine_core,
    lora_engine_args,
)
from async_grpo.inference.owner import claim_engine_processes
from async_grpo.inference.push_kinds import PushKind, kind_of_folder, push_kind
from async_grpo.inference.types import (
    AdapterServing,
    Completion,
    RequestError,
    SamplingSettings,
)
from async_grpo.inference.worker_base import RegisteredWorker
from async_grpo.shm_files import new_entry

ENGINE_WATCH_S = 0.5  # how often a worker checks that its engine core still runs
RECEIVE_MARGIN_S = 60.0  # a push watchdog outlasts the broadcast group's receive timeout


class GenerationWorker(RegisteredWorker):
    """A vLLM engine that serves many `generate` calls at once and accepts weight updates."""

    pool = "generation"

    def __init__(
        self,
        model_dir: str,
        cfg: GenerationConfig,
        worker_id: str | None = None,
        device: str = "cpu",
        adapters: AdapterServing | None = None,
    ) -> None:
        super().__init__(worker_id or f"gen-{uuid.uuid4().hex[:6]}", cfg.max_concurrent_seqs)
        self.model_dir, self.cfg, self.device = model_dir, cfg, device
        self.adapters = adapters  # LoRA serving (a run that pushes adapters), or None
        self.lora: AdapterVersions | None = None  # the adapter versions in service
        self.push_kind: PushKind = push_kind("weights")  # set by init_weight_transfer
        self._adapter_folder = Path()  # where the adapter push under way is written
        self.engine: Any = None
        self._update_lock = asyncio.Lock()
        self._watchdog: asyncio.Task | None = None  # ends a push that stops arriving
        self._push: tuple[int, float] = (0, 0.0)  # (version, timeout_s) of the push under way
        self._engine_watch: asyncio.Task | None = None
        self._chunk_turn = asyncio.Condition()  # chunks of a push load in index order
        self._next_chunk = 0
        self.broadcast_rank: int | None = None  # this engine's first rank in a broadcast group
        self._attempt: int | None = None  # the push under way (paused), None between pushes
        # vLLM's update session is open (start_weight_update without its finish yet); vLLM
        # closes it itself when an update_weights call raises (gpu_worker.update_weights)
        self._session_open = False
        self.requests_served = 0
        self.prefix_reset_failures = 0  # updates after which vLLM kept old prefix blocks
        self.last_drain_s = 0.0  # how long the last update waited for running requests
        self.weight_reload = ""  # "in_place" or "layerwise" (vllm_ext), once the engine is up

    async def start(self, register: bool = True) -> str:
        """Build the engine (tens of seconds on CPU), then register with the pool's registry."""
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from async_grpo.models import in_dtype
        from async_grpo.precision import resolve_dtype

        c = self.cfg
        self.bind_cores(c.cpus, "generation.cpus")
        precision = resolve_dtype(c.dtype, self.device)
        self.dtype = precision.dtype
        print(f"{self.worker_id}: vLLM computes in {precision.describe()}", flush=True)
        # the weights stored in the engine's dtype: loaded as they are, no cast per tensor
        model = await asyncio.to_thread(in_dtype, self.model_dir, precision.dtype)
        args = AsyncEngineArgs(
            model=str(model),
            dtype=precision.dtype,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_concurrent_seqs,
            enforce_eager=c.enforce_eager,
            seed=c.seed,
            tensor_parallel_size=c.tensor_parallel_size,
            gpu_memory_utilization=c.gpu_memory_utilization,
            logprobs_mode="processed_logprobs",  # log-probs after temperature, as the trainer computes
            worker_extension_cls="async_grpo.inference.vllm_ext.WeightSyncExtension",
            weight_transfer_config={"backend": "async_grpo"},  # registered by the extension
            disable_log_stats=True,
            **cpu_scheduler_args(c, self.device),
            **cpu_kv_cache_args(c, self.device),
            **lora_engine_args(self.adapters),
        )
        if self.adapters is not None:
            # in the run's folder in /dev/shm, which the run sweeps however this worker ends
            self.lora = AdapterVersions(Path(new_entry(f"adapters-{self.worker_id}")))
        claim_engine_processes()  # they end with this actor, however it ends
        with forked_engine_core(self.device):
            self.engine = AsyncLLM.from_engine_args(args)
        self._engine_watch = self._background(self._watch_engine(), "engine watch")
        (self.weight_reload,) = set(await self.engine.collective_rpc("async_grpo_reload_kind"))
        print(f"{self.worker_id}: weight updates load {self.weight_reload}", flush=True)
        await self.engine.update_weight_version(str(self.version))
        if register:
            await self.register()
        return self.worker_id

    async def generate(
        self, prompt_ids: list[int], n: int, sampling: SamplingSettings | None = None
    ) -> list[Completion]:
        """`n` completions of one prompt, each with per-token log-probs."""
        fault_point("generation.generate")
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        s = sampling or SamplingSettings(
            self.cfg.max_new_tokens, self.cfg.temperature, self.cfg.top_p
        )
        room = self.cfg.max_model_len - len(prompt_ids)
        if room < 1:
            raise RequestError(
                f"{self.worker_id}: prompt of {len(prompt_ids)} tokens leaves no room in"
                f" max_model_len={self.cfg.max_model_len}"
            )
        params = SamplingParams(
            n=n,
            max_tokens=min(s.max_new_tokens, room),
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.seed,
            stop=list(s.stop) or None,
            logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        version = self.version
        # an adapter run: the request keeps its version's adapter to its last token
        serial, adapter, lora_request = self.lora.acquire() if self.lora else (None,) * 3
        self.in_flight += n
        self.clock.enter()
        # a caller that gives up cancels this call (ray.cancel): the CancelledError raised
        # here makes vLLM abort the request, so no ghost work keeps the engine busy
        try:
            final = None
            async for out in self.engine.generate(
                TokensPrompt(prompt_token_ids=prompt_ids),
                params,
                request_id=uuid.uuid4().hex,
                lora_request=lora_request,
            ):
                final = out
        except ValueError as e:  # vLLM's input validation: this request alone is bad
            raise RequestError(f"{self.worker_id}: request refused by vLLM: {e}") from None
        except Exception:
            self._exit_if_engine_died()
            raise
        finally:
            self.in_flight -= n
            self.clock.leave()
            if self.lora is not None:
                self.lora.release(serial)
                await self._retire_adapters()
        self.requests_served += 1
        if adapter is not None:  # the adapter's version, for every token
            return [_completion(o, adapter, None) for o in final.outputs]
        return [
            _completion(
                o,
                sampled_version(o.weight_versions, version),
                token_versions(o.weight_versions, len(o.token_ids), version),
            )
            for o in final.outputs
        ]

    async def ping(self) -> dict[str, Any]:
        """The base fields, plus the requests the engine still runs (aborts included). A
        worker whose engine died never answers: it ends (`_exit_if_engine_died`)."""
        self._exit_if_engine_died()
        running = self.engine.get_num_unfinished_requests() if self.engine is not None else 0
        return await super().ping() | {
            "engine_requests": running,
            "prefix_reset_failures": self.prefix_reset_failures,
            "last_drain_s": self.last_drain_s,
            "weight_reload": self.weight_reload,
        }

    def place(self) -> tuple[str, str, bool]:
        """(Ray node id, device, broadcast only): the device is "cpu" or the uuid of the
        GPU this engine uses; see transports.select.Place."""
        import ray
        import torch

        node = ray.get_runtime_context().get_node_id()
        device = "cpu" if self.device == "cpu" else str(torch.cuda.get_device_properties(0).uuid)
        return node, device, self.cfg.weight_transport == "broadcast"

    def group_size(self) -> int:
        """Ranks this engine takes in a broadcast group: one per tensor-parallel shard."""
        return self.cfg.tensor_parallel_size

    async def init_weight_transfer(self, info: dict[str, Any]) -> str:
        """Open this engine's end of the transport the trainer chose (info["kind"])."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self.push_kind = push_kind(info.get("payload", "weights"))
        self.push_kind.check_worker(self)
        await self.engine.init_weight_transfer_engine(
            WeightTransferInitRequest(init_info={"info": info})
        )
        self.transport = info["kind"]
        self.broadcast_rank = info.get("rank_offset")  # None off the broadcast group
        return self.transport

    async def begin_update(
        self, version: int, timeout_s: float, attempt: int = 0, in_flight: bool = False
    ) -> float:
        """Pause, start vLLM's layerwise reload; returns the seconds spent pausing. Without
        `in_flight`, running requests first finish on the current weights and the caches are
        cleared; with it, they are frozen where they are and, once the new weights are in,
        preempted so that their KV is recomputed under them (`end_update`): a token never
        comes from KV of another version than its own label. The worker ends its process
        unless each next call of the push (a chunk, `end_update`) comes within `timeout_s`.

        Called again before `end_update` (the trainer resends a push that broke off when
        another worker died), it stays paused and starts the reload over."""
        if self._attempt is not None:
            return await self._restart_update(version, timeout_s, attempt)
        drain_s = await self.push_kind.begin(self, version, timeout_s, attempt, in_flight)
        self._session_open = True
        self._push = (version, timeout_s)
        self._arm_watchdog()
        return drain_s

    def adapter_status(self) -> dict[str, list[Any]]:
        """The adapter versions in service and the pushed versions' folders on disk."""
        if self.lora is None:
            return {"served": [], "folders": []}
        root = self.lora.root
        folders = sorted(f.name for f in root.iterdir()) if root.is_dir() else []
        return {"served": self.lora.versions(), "folders": folders}

    async def _retire_adapters(self) -> None:
        """Unload the versions no request uses any more (not the newest)."""
        for served in self.lora.retired():
            await self.engine.remove_lora(served.request.lora_int_id)
            self.lora.remove(served)

    async def _restart_update(self, version: int, timeout_s: float, attempt: int) -> float:
        if self._watchdog is not None:
            self._watchdog.cancel()
        async with self._chunk_turn:  # chunk calls of the broken attempt give up
            self._attempt = attempt
            self._chunk_turn.notify_all()
        # close vLLM's half-done reload (layers not loaded keep their tensors), open anew;
        # nothing is served in between: generation stays paused. A chunk that failed in the
        # engine (a broadcast whose sender's group broke) closed vLLM's session but not our
        # reload: reopen it first (the reload's set-up skips layers already set up), so that
        # the finish below completes the half-done reload as in every other case.
        if not self._session_open:
            await self.engine.start_weight_update()
        await self.engine.finish_weight_update(weight_version=str(self.version))
        await self.engine.start_weight_update()
        self._session_open = True
        self._next_chunk = 0
        self._push = (version, timeout_s)
        self._arm_watchdog()
        return 0.0

    async def load_chunk(
        self,
        index: int,
        metas: list[tuple[str, list[int], str]],
        slot: int,
        nbytes: int,
        attempt: int = 0,
    ) -> None:
        """Load chunk `index` of this push from `slot` (or from the broadcast now under way).
        Chunks load in order whatever order their calls arrive in; a chunk of a push
        attempt that was started over is refused."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        fault_point("generation.load_chunk")
        if self.broadcast_rank is not None:  # a death at a chosen place in the group
            fault_point(f"generation.load_chunk.rank{self.broadcast_rank}")
        async with self._chunk_turn:
            await self._chunk_turn.wait_for(
                lambda: self._attempt != attempt or self._next_chunk == index
            )
            if self._attempt != attempt:
                raise RuntimeError(f"{self.worker_id}: chunk {index} of a push started over")
            info = {"metas": metas, "slot": slot, "nbytes": nbytes}
            try:
                await self.engine.update_weights(WeightTransferUpdateRequest(update_info=info))
            except Exception:
                self._exit_if_engine_died()
                self._session_open = False  # vLLM ended its update session on the error
                raise
            self._next_chunk += 1
            self._arm_watchdog()  # the push's timeout holds per chunk, not for the whole push
            self._chunk_turn.notify_all()

    async def end_update(self, version: int) -> dict[str, int]:
        """Finish the reload, label new tokens `version`, resume; returns the version served
        and this worker's counts of prefix-cache resets that failed and checkpoints it could
        not load (both should stay 0)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._attempt = None
        self._session_open = False  # the push kind's end finishes vLLM's session
        await self.push_kind.end(self, version)
        return self._update_result()

    def _update_result(self) -> dict[str, int]:
        return {
            "version": self.version,
            "prefix_reset_failures": self.prefix_reset_failures,
            "weight_load_failures": self.weight_load_failures,
        }

    async def load_weights_dir(self, hf_dir: str, version: int) -> int:
        """Load a Hugging Face folder (a checkpoint) as `version`, paused like a push; an
        adapter checkpoint is served beside the running requests' adapters instead."""
        kind = kind_of_folder(hf_dir)
        if kind.name == "adapter" and self.lora is None:
            self.weight_load_failures += 1
            print(f"{self.worker_id}: {hf_dir} is an adapter; this engine serves none")
            return self.version
        await kind.load_folder(self, hf_dir, version)
        return self.version

    async def _after_update(self, version: int) -> None:
        # requests frozen by an in-flight update are preempted: their blocks are freed and
        # their prompt and tokens so far are prefilled again under the new weights
        if not await self.engine.reset_prefix_cache(reset_running_requests=True):
            self.prefix_reset_failures += 1
        self.version = self.clock.version = version
        await self.report_version()

    async def _resume(self) -> None:
        await self.engine.resume_generation()
        self.clock.pause(False)
        self._update_lock.release()

    def _arm_watchdog(self) -> None:
        """(Re)start the wait for the push's next call: none within its timeout ends it."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watchdog = self._background(self._abandon_after(*self._push), "push watchdog")

    async def _abandon_after(self, version: int, timeout_s: float) -> None:
        """The trainer vanished mid-push: the weights are half loaded, so this worker ends
        (a replacement loads the newest checkpoint). It waits `RECEIVE_MARGIN_S` (at most
        the timeout again) past the push's timeout: a broadcast receive that a broken group
        left blocked fails at the group's own timeout (the same `timeout_s`, counted from a
        later start), and the worker must still be there to take the push sent again."""
        wait_s = timeout_s + min(RECEIVE_MARGIN_S, timeout_s)
        await asyncio.sleep(wait_s)
        self._exit(
            f"push of version {version}: no chunk within {wait_s:.0f}s; the weights are incomplete"
        )

    async def _watch_engine(self) -> None:
        while True:
            await asyncio.sleep(ENGINE_WATCH_S)
            self._exit_if_engine_died()

    def _exit_if_engine_died(self) -> None:
        """A dead engine core cannot come back in this actor: end the process."""
        if self.engine is not None and self.engine.errored:
            self._exit("vLLM's engine core died")

    async def stop(self, drain_timeout_s: float = 30.0) -> dict[str, int]:
        """Deregister, let running requests finish (up to the timeout), shut the engine."""
        result = await self.drain(drain_timeout_s)
        if self._engine_watch is not None:
            self._engine_watch.cancel()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.lora is not None:
            self.lora.clear()
        return result


def _completion(o: Any, version: int, versions: list[int] | None) -> Completion:
    """One of vLLM's outputs as our Completion, sampled by `version` (each token by
    `versions`, when they differ)."""
    return Completion(
        list(o.token_ids),
        [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs, strict=True)],
        o.text,
        "length" if o.finish_reason == "length" else "stop",
        version,
        versions,
    )


def token_versions(spans: list[Any] | None, n: int, started: int) -> list[int] | None:
    """The version that sampled each of `n` tokens, from vLLM's spans ([start, end) ranges
    of output tokens and the weight version that produced them); None when every token has
    one version (no update came during the request)."""
    out = [started] * n
    for v in spans or []:
        lo, hi = max(0, v.start), min(n, v.end)
        if str(v.version).isdigit() and hi > lo:
            out[lo:hi] = [int(v.version)] * (hi - lo)
    return out if len(set(out)) > 1 else None


def sampled_version(spans: list[Any] | None, started: int) -> int:
    """The oldest weight version vLLM reports for a completion's tokens (`started`, the
    version when the request was sent, where vLLM reported none)."""
    versions = [int(v.version) for v in spans or [] if str(v.version).isdigit()]
    return min(versions) if versions else started
