"""`adapter`: LoRA factors alone (`trainer.lora.push: adapter`).

Nothing pauses: requests keep the adapter of the version they started with. The engine
copies each chunk's tensors out of the slot, writes the adapter's folder when the push
ends, and the worker then serves it as the new version's adapter beside the running
ones (inference/adapter_versions.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from async_grpo.inference.push_kinds.base import PushKind


class AdapterPush(PushKind):
    name = "adapter"

    def check_worker(self, worker: Any) -> None:
        if worker.lora is None:
            raise RuntimeError(
                f"{worker.worker_id}: the trainer pushes LoRA adapters but this engine was"
                " started without LoRA serving (start workers with the run's config)"
            )

    async def begin(
        self, worker: Any, version: int, timeout_s: float, attempt: int, in_flight: bool
    ) -> float:
        await worker._update_lock.acquire()
        try:
            worker._adapter_folder = worker.lora.next_folder(version)
            folder = str(worker._adapter_folder)
            await worker.engine.collective_rpc("async_grpo_adapter_target", args=(folder,))
            await worker.engine.start_weight_update()
            worker._next_chunk, worker._attempt = 0, attempt
        except BaseException:
            worker._update_lock.release()
            raise
        worker.last_drain_s = 0.0
        return 0.0

    async def end(self, worker: Any, version: int) -> None:
        try:
            await worker.engine.finish_weight_update()
            await self._serve(worker, version, worker._adapter_folder, owned=True)
        finally:
            worker._update_lock.release()

    async def load_folder(self, worker: Any, folder: str, version: int) -> None:
        async with worker._update_lock:
            await self._serve(worker, version, Path(folder), owned=False)

    @staticmethod
    async def _serve(worker: Any, version: int, folder: Path, owned: bool) -> None:
        """Serve the adapter in `folder` as `version` to new requests: loaded into the
        engine now (a folder vLLM cannot load fails here, not in a request)."""
        request = worker.lora.add(version, folder, owned)
        if not await worker.engine.add_lora(request):
            raise RuntimeError(f"{worker.worker_id}: vLLM did not load adapter {folder}")
        worker.version = worker.clock.version = version
        await worker.report_version()
        await worker._retire_adapters()

    def start(self, ext: Any) -> None:
        ext._adapter = {}  # the model is untouched: the tensors go to a folder

    def receive(self, ext: Any, tensors: list[tuple[str, Any]], flat: Any) -> None:
        ext._adapter |= {name: t.clone() for name, t in tensors}  # the trainer reuses the slot

    def finish(self, ext: Any) -> None:
        from async_grpo.adapters import write_adapter

        write_adapter(Path(ext.adapter_target), ext._adapter, ext.adapter_config)
        ext._adapter = {}
