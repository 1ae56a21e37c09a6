"""EvalHook: held-out evaluation during a run, driven from trainer rank 0.

After each due push (the starting weights, every `eval.every` versions, the final ones)
it starts an evaluation of that version in the `Evaluator` actor and goes on training.
The next push waits for it (`before_push`), so every eval sample is of exactly the
version evaluated; that wait is the eval's cost to the trainer (`eval/trainer_wait_s`).
Each result is one metrics row at step = its version, with `eval/*` keys only.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from async_grpo.config import RunConfig
from async_grpo.data.held_out import held_out_prompts
from async_grpo.hooks import HookContext, TrainingHook

COLLECT_SLACK_S = 60.0


class EvalHook(TrainingHook):
    name = "eval"

    def __init__(self, cfg: RunConfig, model_dir: str, start_step: int) -> None:
        self.cfg, self.start_step = cfg, start_step
        self.prompts = held_out_prompts(cfg, model_dir)  # refused before anything starts
        self.actor: Any = None
        self.ctx: HookContext | None = None
        self.started: dict[int, float] = {}  # version -> elapsed time when pushed
        self.wait_s: dict[int, float] = {}  # version -> trainer seconds spent waiting
        self.t0 = time.perf_counter()

    @property
    def wants_final_push(self) -> bool:
        return True

    def due(self, version: int) -> bool:
        e = self.cfg.eval
        if version == self.start_step:
            return e.at_start
        last = self.ctx.last_version if self.ctx is not None else None
        return version % e.every == 0 or version == (last or self.cfg.trainer.max_steps)

    def on_start(self, ctx: HookContext) -> None:
        import ray

        from async_grpo.evaluation.runner import Evaluator
        from async_grpo.logs import actor_runtime_env
        from async_grpo.ray_utils import NAMESPACE, on_this_node

        self.ctx, self.t0 = ctx, time.perf_counter()
        if self.start_step and self._logged(ctx, self.start_step):  # resumed: once per version
            self.started[self.start_step] = 0.0
        logs = ctx.extra.get("log_dir")
        self.actor = (
            ray.remote(Evaluator)
            .options(
                name=f"evaluator:{os.path.abspath(self.cfg.output_dir)}",
                namespace=NAMESPACE,
                num_cpus=0,
                max_concurrency=100,
                runtime_env=actor_runtime_env(None, logs, "evaluator"),
                **on_this_node(),
            )
            .remote(
                self.cfg.eval,
                self.cfg.generation.max_new_tokens,
                self.prompts,
                verifier=self.cfg.verifier,
            )
        )

    @staticmethod
    def _logged(ctx: HookContext, version: int) -> bool:
        """The kept metrics already hold the evaluation of `version` (a resumed run)."""
        from async_grpo.metrics import METRICS_FILE, read_metrics

        path = ctx.output_dir / METRICS_FILE
        rows = read_metrics(path) if path.is_file() else []
        return any(r.get("step") == version and "eval/policy_version" in r for r in rows)

    def after_push(self, version: int) -> None:
        if self.due(version) and version not in self.started:
            self._ask("start", version)
            self.started[version] = time.perf_counter() - self.t0

    def before_push(self, version: int) -> None:
        """The evaluation of the version being replaced must finish first; results that
        finished before it are collected too (at the run's end no later step would)."""
        if self.actor is None:
            return
        t = time.perf_counter()
        results = self._ask("wait", self.cfg.eval.timeout_s, timeout_s=self.cfg.eval.timeout_s)
        waited = time.perf_counter() - t
        for r in results:
            self.wait_s[r.version] = waited
        self._write(results)

    def after_step(self, step: int, metrics: dict[str, float], samples: list[dict]) -> None:
        self._write(self._ask("finished"))

    def on_end(self) -> None:
        if self.actor is None:
            return
        self.before_push(-1)  # the last evaluations, waited for
        import ray

        ray.kill(self.actor)
        self.actor = None

    def _ask(self, method: str, *args: Any, timeout_s: float = 0.0) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError

        limit = timeout_s + COLLECT_SLACK_S
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=limit)
        except GetTimeoutError:
            raise TimeoutError(
                f"the evaluator did not answer {method} within {limit:.0f}s"
            ) from None

    def _write(self, results: list[Any]) -> None:
        assert self.ctx is not None
        for r in results:
            if r.error:
                print(
                    f"warning: eval of version {r.version}: {r.error}", file=sys.stderr, flush=True
                )
            if not r.metrics:
                continue
            row = dict(r.metrics)
            row["eval/trainer_wait_s"] = self.wait_s.pop(r.version, 0.0)
            row["time/elapsed"] = self.started.get(r.version, 0.0)
            self.ctx.log(r.version, row)
            self.ctx.hooks.call("after_eval", r.version, r)
