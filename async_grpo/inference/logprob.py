"""LogprobWorker: per-token log-probs of given completions under a transformers model.

In: (prompt ids, completion ids) pairs. Out: one log-prob per completion token. Used as the
frozen reference model (KL penalty) or, with weight updates, as the old policy.
Requests from many callers are packed into padding-free rows of at most
`max_tokens_per_batch` tokens; a sample longer than that is scored alone in its own row
(up to the model's context), never refused for its length. The forward runs in a thread
so the actor keeps answering.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

from async_grpo.config import LogprobConfig
from async_grpo.faults import fault_point
from async_grpo.inference.types import RequestError
from async_grpo.inference.worker_base import RegisteredWorker


@dataclass
class _Pending:
    prompt_ids: list[int]
    completion_ids: list[int]
    future: asyncio.Future


class LogprobWorker(RegisteredWorker):
    """A transformers causal LM behind a batching queue."""

    pool = "logprob"

    def __init__(
        self,
        model_dir: str,
        cfg: LogprobConfig,
        worker_id: str | None = None,
        device: str = "cpu",
        temperature: float = 1.0,
    ) -> None:
        # capacity: sequences a caller may lease at once; the token budget does the batching
        super().__init__(worker_id or f"lp-{uuid.uuid4().hex[:6]}", capacity=256)
        self.model_dir, self.cfg, self.device, self.temperature = (
            model_dir,
            cfg,
            device,
            temperature,
        )
        self.model: Any = None
        self.max_len = 0
        self._queue: asyncio.Queue[_Pending] | None = None
        self._loop_task: asyncio.Task | None = None
        self.tokens_scored = 0
        self.attention: Any = None

    async def start(self, register: bool = True) -> str:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from async_grpo.core.attention import select_attention
        from async_grpo.precision import resolve_dtype

        self.bind_cores(self.cfg.cpus, "logprob.cpus")
        torch.set_num_threads(self.cfg.threads)
        precision = resolve_dtype(self.cfg.dtype, self.device)
        self.dtype = precision.dtype
        self.attention, why = select_attention(
            self.cfg.attention, self.device, False, False, self.cfg.max_tokens_per_batch
        )
        print(
            f"{self.worker_id}: computes in {precision.describe()}, attention"
            f" {self.attention.name} ({why})",
            flush=True,
        )
        config = await asyncio.to_thread(AutoConfig.from_pretrained, self.model_dir)
        self.model = await asyncio.to_thread(
            AutoModelForCausalLM.from_pretrained,
            self.model_dir,
            config=config,
            dtype=precision.torch_dtype,
            attn_implementation=self.attention.implementation(config),
        )
        self.model.to(self.device).eval().requires_grad_(False)
        self.max_len = self.model.config.max_position_embeddings
        self._queue = asyncio.Queue()
        self._loop_task = self._background(self._serve(), "serving loop")
        if register:
            await self.register()
        return self.worker_id

    async def logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Log-probs of each completion token given its prompt, in request order."""
        fault_point("logprob.logprobs")
        for p, c in pairs:
            if not p or not c:
                raise RequestError(f"{self.worker_id}: empty prompt or completion")
            if len(p) + len(c) > self.max_len:
                raise RequestError(
                    f"{self.worker_id}: sample of {len(p) + len(c)} tokens exceeds"
                    f" the model context {self.max_len}"
                )
        loop = asyncio.get_running_loop()
        pending = [_Pending(p, c, loop.create_future()) for p, c in pairs]
        self.in_flight += len(pairs)
        try:
            for item in pending:
                self._queue.put_nowait(item)
            return list(await asyncio.gather(*(item.future for item in pending)))
        finally:
            self.in_flight -= len(pairs)

    async def _serve(self) -> None:
        """Take queued samples up to the token budget (a longer one alone), score them in
        one packed forward. A failed forward fails only its own callers; the loop goes on."""
        budget = self.cfg.max_tokens_per_batch
        carry: _Pending | None = None
        while True:
            batch = [carry or await self._queue.get()]
            carry = None
            size = len(batch[0].prompt_ids) + len(batch[0].completion_ids)
            while not self._queue.empty():
                item = self._queue.get_nowait()
                n = len(item.prompt_ids) + len(item.completion_ids)
                if size + n > budget:
                    carry = item
                    break
                batch.append(item)
                size += n
            try:
                results = await asyncio.to_thread(self._score, batch)
            except Exception as e:  # a failed forward fails only this batch's callers
                for item in batch:
                    if not item.future.done():  # a caller may have gone (cancelled)
                        item.future.set_exception(
                            RuntimeError(f"{self.worker_id}: forward failed: {e}")
                        )
                continue
            for item, lp in zip(batch, results, strict=True):
                if not item.future.done():
                    item.future.set_result(lp)

    def _score(self, batch: list[_Pending]) -> list[list[float]]:
        import torch

        from async_grpo.core.logprobs import batch_logprobs
        from async_grpo.core.packing import PackInput, pack

        inputs = [
            PackInput(b.prompt_ids, b.completion_ids, 0.0, [0.0] * len(b.completion_ids))
            for b in batch
        ]
        with torch.no_grad():
            packed = self.attention.prepare(pack(inputs)).to(self.device)
            logp, _ = batch_logprobs(self.model, packed, self.temperature, attention=self.attention)
            flat = logp[packed.loss_mask].float().cpu().tolist()
        self.tokens_scored += packed.input_ids.shape[1]
        out, offset = [], 0
        for b in batch:
            out.append(flat[offset : offset + len(b.completion_ids)])
            offset += len(b.completion_ids)
        return out

    async def stats(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "tokens_scored": self.tokens_scored,
            "version": self.version,
        }

    async def stop(self, drain_timeout_s: float = 30.0) -> dict[str, int]:
        result = await self.drain(drain_timeout_s)
        if self._loop_task is not None:
            self._loop_task.cancel()
        return result
