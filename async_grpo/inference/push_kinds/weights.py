"""`weights`: every weight of the model (full fine-tuning, or LoRA merged into the base).

Generation pauses (running requests finish first, or with `in_flight` are frozen and
recomputed after), vLLM's layerwise reload takes each chunk's layers as they complete,
and the new version labels every token from the end of the push on."""

from __future__ import annotations

import time
from typing import Any

from async_grpo.deadline import within
from async_grpo.inference.push_kinds.base import PushKind


class WeightsPush(PushKind):
    name = "weights"

    async def begin(
        self, worker: Any, version: int, timeout_s: float, attempt: int, in_flight: bool
    ) -> float:
        await worker._update_lock.acquire()
        try:
            t = time.perf_counter()
            if in_flight:
                pause = worker.engine.pause_generation(mode="keep", clear_cache=False)
            else:
                pause = worker.engine.pause_generation(mode="wait", clear_cache=True)
            try:
                await within(pause, timeout_s)
            except TimeoutError:
                waited = "froze" if in_flight else "finished"
                raise TimeoutError(
                    f"generation worker {worker.worker_id}: its running requests were not"
                    f" {waited} within {timeout_s:g} s, so the push of version {version}"
                    " did not start there"
                ) from None
            worker.last_drain_s = time.perf_counter() - t
            worker.clock.pause(True)
            await worker.engine.start_weight_update()
            worker._next_chunk, worker._attempt = 0, attempt
        except BaseException:
            await worker._resume()
            raise
        return worker.last_drain_s

    async def end(self, worker: Any, version: int) -> None:
        try:
            await worker.engine.finish_weight_update(weight_version=str(version))
            await worker._after_update(version)
        finally:
            await worker._resume()

    async def load_folder(self, worker: Any, folder: str, version: int) -> None:
        await worker._update_lock.acquire()
        try:
            await worker.engine.pause_generation(mode="wait", clear_cache=True)
            worker.clock.pause(True)
            await worker.engine.collective_rpc("async_grpo_load_dir", args=(folder,))
            await worker.engine.update_weight_version(str(version))
            await worker._after_update(version)
        finally:
            await worker._resume()

    def start(self, ext: Any) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        from async_grpo.inference import vllm_reload as vllm_ext

        ext._in_place = vllm_ext.reloads_in_place(ext.model)
        if not ext._in_place:
            vllm_ext.prepack_experts_on_update(ext.model)
            initialize_layerwise_reload(ext.model)

    def receive(self, ext: Any, tensors: list[tuple[str, Any]], flat: Any) -> None:
        from async_grpo.inference import vllm_reload as vllm_ext

        tied = ext.model_config.hf_config.tie_word_embeddings
        if (ext._in_place and tied) or not vllm_ext.has_head(ext.model):
            # a tied head is the embedding's own tensor here (no repacked copy to refresh),
            # and vLLM refuses a chunk that holds the head without the embedding; a model
            # without a head of its own (Gemma) has no parameter of that name at all
            tensors = [(name, t) for name, t in tensors if name != vllm_ext.HEAD]
        ext.model.load_weights(tensors)
        if not ext._in_place:
            vllm_ext.own_pending(flat)

    def finish(self, ext: Any) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not ext._in_place:
            finalize_layerwise_reload(ext.model, ext.model_config)
