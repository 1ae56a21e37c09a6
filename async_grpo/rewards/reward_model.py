"""A reward model: `RewardModelWorker` scores (prompt, completion) pairs with a transformers
`AutoModelForSequenceClassification` of one label, in token-budgeted batches.

In: (prompt, completion) pairs; a prompt is text or chat messages, the completion untrusted
text. Out: one `(score or None, reason)` each, in order: the model's logit for the pair
written as the model's chat template writes a user turn and the assistant's reply (the
prompt's text then the completion, for a model without one). None when the score is not
finite (`not_finite: ...`); the batcher gives it `verifier.reward_model.fallback` and
counts it (batcher/model_scores.py).

Why transformers and not vLLM's pooling runner: the score must be the number the user's
own `AutoModelForSequenceClassification` gives for the text (the logit at the last token,
before any activation), for every architecture transformers can classify with; vLLM's
runner serves a subset of them and applies its own pooler settings. A batch is right-padded
and the model itself picks each row's last token, so a score does not depend on its batch
(a test).
"""

from __future__ import annotations

import asyncio
import math
import uuid
from dataclasses import dataclass
from typing import Any

from async_grpo.config import RewardModelConfig
from async_grpo.faults import fault_point
from async_grpo.inference.worker_base import RegisteredWorker

CAPACITY = 1024  # pairs a caller may lease at once; the token budget does the batching


@dataclass
class _Pending:
    ids: list[int]
    future: asyncio.Future


def is_classifier(config: Any) -> str | None:
    """Why a model config is not a one-score sequence classifier, or None when it is."""
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        return f"its architectures {archs} hold no *ForSequenceClassification"
    if getattr(config, "num_labels", 1) != 1:
        return f"it has {config.num_labels} labels, and a reward model gives one score"
    return None


class RewardModelWorker(RegisteredWorker):
    """A sequence classifier behind a batching queue."""

    pool = "reward_model"

    def __init__(
        self,
        model_dir: str,
        cfg: RewardModelConfig,
        worker_id: str | None = None,
        device: str = "cpu",
    ) -> None:
        super().__init__(worker_id or f"rm-{uuid.uuid4().hex[:6]}", CAPACITY)
        self.model_dir, self.cfg, self.device = model_dir, cfg, device
        self.model: Any = None
        self.tokenizer: Any = None
        self._queue: asyncio.Queue[_Pending] | None = None
        self._loop_task: asyncio.Task | None = None
        self.max_length = cfg.max_length  # and no more than the model's positions, once started
        self.scored = 0
        self.batches = 0

    async def start(self, register: bool = True) -> str:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from async_grpo.precision import resolve_dtype

        self.bind_cores(self.cfg.cpus, "verifier.reward_model.cpus")
        torch.set_num_threads(self.cfg.threads)
        precision = resolve_dtype(self.cfg.dtype, self.device)
        self.dtype = precision.dtype
        print(f"{self.worker_id}: computes in {precision.describe()}", flush=True)
        self.tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.model_dir)
        self.model = await asyncio.to_thread(
            AutoModelForSequenceClassification.from_pretrained,
            self.model_dir,
            dtype=precision.torch_dtype,
        )
        if self.model.config.pad_token_id is None:  # batches are padded with it
            pad = self.tokenizer.pad_token_id
            self.model.config.pad_token_id = pad if pad is not None else self.tokenizer.eos_token_id
        self.model.to(self.device).eval().requires_grad_(False)
        positions = getattr(self.model.config, "max_position_embeddings", None)
        self.max_length = min(self.cfg.max_length, positions or self.cfg.max_length)
        self._queue = asyncio.Queue()
        self._loop_task = self._background(self._serve(), "serving loop")
        if register:
            await self.register()
        return self.worker_id

    def pair_ids(self, prompt: Any, completion: str) -> list[int]:
        """The pair's token ids (its last `max_length` when longer: the completion's end
        matters most)."""
        if isinstance(prompt, list):
            messages = [dict(m) for m in prompt]
        else:
            messages = [{"role": "user", "content": str(prompt)}]
        if self.tokenizer.chat_template:
            messages.append({"role": "assistant", "content": completion})
            ids = self.tokenizer.apply_chat_template(messages, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding
                ids = ids["input_ids"]
            ids = [int(t) for t in ids]
        else:
            text = "\n".join(str(m.get("content", "")) for m in messages) + completion
            ids = self.tokenizer(text)["input_ids"]
        return ids[-self.max_length :]

    async def score(self, pairs: list[tuple[Any, str]]) -> list[tuple[float | None, str]]:
        """One (score or None, reason) per (prompt, completion), in order."""
        fault_point("reward_model.score")
        loop = asyncio.get_running_loop()
        pending = [_Pending(self.pair_ids(p, c), loop.create_future()) for p, c in pairs]
        self.in_flight += len(pairs)
        self.clock.enter()
        try:
            for item in pending:
                self._queue.put_nowait(item)
            scores = await asyncio.gather(*(item.future for item in pending))
        finally:
            self.in_flight -= len(pairs)
            self.clock.leave()
        return [
            (s, "") if math.isfinite(s) else (None, f"not_finite: the reward model gave {s}")
            for s in scores
        ]

    async def _serve(self) -> None:
        """Take queued pairs while the padded batch stays within the token budget (a longer
        pair alone), score them in one forward. A failed forward fails only its callers."""
        budget = self.cfg.max_tokens_per_batch
        carry: _Pending | None = None
        while True:
            batch = [carry or await self._queue.get()]
            carry = None
            longest = len(batch[0].ids)
            while not self._queue.empty():
                item = self._queue.get_nowait()
                if (len(batch) + 1) * max(longest, len(item.ids)) > budget:
                    carry = item
                    break
                batch.append(item)
                longest = max(longest, len(item.ids))
            try:
                scores = await asyncio.to_thread(self._forward, [b.ids for b in batch])
            except Exception as e:
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(
                            RuntimeError(f"{self.worker_id}: forward failed: {e}")
                        )
                continue
            for item, s in zip(batch, scores, strict=True):
                if not item.future.done():
                    item.future.set_result(s)

    def _forward(self, rows: list[list[int]]) -> list[float]:
        """The model's one logit per row; rows right-padded with the model's pad id."""
        import torch

        width = max(len(r) for r in rows)
        pad = self.model.config.pad_token_id
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        with torch.no_grad():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
        self.scored += len(rows)
        self.batches += 1
        return logits.logits[:, 0].float().cpu().tolist()

    async def ping(self) -> dict[str, Any]:
        return await super().ping() | {"scored": self.scored, "batches": self.batches}

    async def stats(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "scored": self.scored, "batches": self.batches}

    async def stop(self, drain_timeout_s: float = 30.0) -> dict[str, int]:
        result = await self.drain(drain_timeout_s)
        if self._loop_task is not None:
            self._loop_task.cancel()
        return result
