"""The trainer's own hooks (see async_grpo/hooks.py): the checkpoint announcement to
late-joining workers, and the sample log `output_dir/samples.jsonl`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from async_grpo.hooks import HookContext, TrainingHook

SAMPLES_FILE = "samples.jsonl"
SAMPLES_MAX_BYTES = 8 << 20  # the sample log stops growing here (one warning line)


class AnnounceCheckpoint(TrainingHook):
    """After each checkpoint, tell the pools' registries where its HF folder is: a
    worker that joins later loads it before its first push."""

    name = "announce_checkpoint"

    def __init__(self, pusher: Any) -> None:
        self.pusher = pusher

    def after_checkpoint(self, step: int, path: Path) -> None:
        from async_grpo.trainer.checkpoint import weights_dir

        self.pusher.announce_checkpoint(step, str(weights_dir(path)))


class SampleLog(TrainingHook):
    """Appends the samples the batcher picked (`sample_every`, `samples_logged`) to
    output_dir/samples.jsonl with their text decoded: prompt, completion, reward, reason,
    advantage. The file stops at SAMPLES_MAX_BYTES; a resumed run drops the rows of steps
    after its checkpoint first."""

    name = "sample_log"

    def __init__(self, start_step: int, max_bytes: int = SAMPLES_MAX_BYTES) -> None:
        self.start_step, self.max_bytes = start_step, max_bytes
        self.path: Path | None = None
        self.tokenizer: Any = None
        self.full = False

    def on_start(self, ctx: HookContext) -> None:
        self.path = ctx.output_dir / SAMPLES_FILE
        if self.path.is_file():  # each step once, as in the metrics
            kept = [
                line
                for line in self.path.read_text(encoding="utf-8").splitlines(keepends=True)
                if line.endswith("\n") and json.loads(line).get("step", 0) <= self.start_step
            ]
            self.path.write_text("".join(kept), encoding="utf-8")

        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(ctx.model_dir)

    def after_step(self, step: int, metrics: dict[str, float], samples: list[dict]) -> None:
        if not samples or self.full or self.path is None:
            return
        lines = []
        for s in samples:
            row = dict(s)
            row["prompt"] = self.tokenizer.decode(row.pop("prompt_ids"))
            row["completion"] = self.tokenizer.decode(row.pop("completion_ids"))
            lines.append(json.dumps(row, default=str) + "\n")
        text = "".join(lines)
        size = self.path.stat().st_size if self.path.is_file() else 0
        if size + len(text.encode()) > self.max_bytes:
            self.full = True
            print(
                f"warning: {self.path} reached {self.max_bytes >> 20} MiB; no more samples are"
                " logged in this run (raise sample_every to log fewer)",
                file=sys.stderr,
                flush=True,
            )
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(text)
