"""Hooks the integration tests load by path (`hooks: [{path: hooks_for_tests:...}]`)."""

import json
from pathlib import Path

from async_grpo.hooks import TrainingHook


class EventLog(TrainingHook):
    """Appends every event it sees to `path` as JSON lines; after each evaluation also
    `keep` of its sampled completions (the docs' example hook)."""

    def __init__(self, path: str, keep: int = 2) -> None:
        self.path, self.keep = Path(path), keep

    def _write(self, **row) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def before_step(self, step):
        self._write(event="before_step", step=step)

    def after_push(self, version):
        self._write(event="after_push", version=version)

    def after_checkpoint(self, step, path):
        self._write(event="after_checkpoint", step=step, hf=(path / "hf").is_dir())

    def after_eval(self, version, result):
        samples = [s.to_json() for s in result.samples[: self.keep]]
        self._write(
            event="after_eval",
            version=version,
            pass1=result.metrics["eval/pass_at_1"],
            samples=samples,
        )

    def on_end(self):
        self._write(event="on_end")
