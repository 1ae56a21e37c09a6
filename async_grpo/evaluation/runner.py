"""Evaluator: held-out prompts through a generation pool and a verifier pool (and the
judge and reward-model pools, with model rewards), at a version.

A plain class: `async-grpo eval` drives `evaluate` in-process against private workers
(`DirectClient`); during a run it is a Ray actor that the `EvalHook` on trainer rank 0
asks to `start` an evaluation after a push and later collects (`finished`, `wait`).
Generation is leased in the background (registry.lease): a training request waiting for
room always goes first, and at most `max_concurrent_seqs` eval sequences run at once.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from typing import Any

from async_grpo.config import EvalConfig, VerifierConfig
from async_grpo.data import Prompt
from async_grpo.evaluation.scoring import EvalResult, EvalSample, summarize
from async_grpo.inference.types import SamplingSettings

UNSERVED_CHECK_S = 1.0  # how often an evaluation checks that a worker still serves its version


class Evaluator:
    """Evaluates `prompts` (tokenized) at a policy version; `clients` maps "generation" and
    "verifier" to objects with PoolClient's `call` (the run's pools when None)."""

    def __init__(
        self,
        cfg: EvalConfig,
        max_new_tokens: int,
        prompts: list[Prompt],
        clients: dict[str, Any] | None = None,
        verifier: VerifierConfig | None = None,
    ) -> None:
        from async_grpo.logs import to_file

        to_file()  # in a quiet run: this actor's output to OUTPUT_DIR/logs/evaluator.log
        if any(p.input_token_ids is None for p in prompts):
            raise ValueError("Evaluator needs tokenized prompts (input_token_ids)")
        self.cfg, self.prompts, self._clients = cfg, prompts, clients
        self.verifier = verifier or VerifierConfig()
        v = self.verifier
        self.rules = v.rewards if cfg.rewards is None else cfg.rewards
        self.models = v.models if cfg.models is None else cfg.models
        self.counters: dict[str, float] = defaultdict(float)  # the model rewards' outcomes
        self.max_new_tokens = cfg.max_new_tokens or max_new_tokens
        self._running: dict[int, asyncio.Task] = {}
        self._finished: list[EvalResult] = []

    def _pools(self) -> dict[str, Any]:
        if self._clients is None:
            from async_grpo.inference.client import PoolClient

            pools = ["generation"] + (["verifier"] if self.rules else []) + self.models
            self._clients = {p: PoolClient(p) for p in pools}
        return self._clients

    async def evaluate(self, version: int) -> EvalResult:
        """Every prompt, `samples_per_question` completions each from a worker serving
        `version` (or newer), scored; within `timeout_s` (what finished by then counts,
        and `error` says what did not)."""
        c, t0 = self.cfg, time.monotonic()
        samples: list[EvalSample] = []
        failures: list[str] = []
        slots = asyncio.Semaphore(max(1, c.max_concurrent_seqs // c.samples_per_question))

        async def question(q: int, prompt: Prompt) -> None:
            try:
                async with slots:
                    samples.extend(await self._question(q, prompt, version))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # counted: eval/missing_questions, and the error line
                failures.append(f"question {q}: {type(e).__name__}: {e}")

        error = None
        work = asyncio.ensure_future(
            asyncio.gather(*(question(q, p) for q, p in enumerate(self.prompts)))
        )
        unserved = asyncio.ensure_future(self._unserved(version))
        done, _ = await asyncio.wait(
            {work, unserved}, timeout=c.timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        unserved.cancel()
        if work not in done:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            error = f"not finished within eval.timeout_s={c.timeout_s:g}s"
            if unserved in done and unserved.exception() is not None:  # the registry failed
                e = unserved.exception()
                error = f"the generation registry could not be asked: {type(e).__name__}: {e}"
            elif unserved in done:  # the trainer's next push is what can serve it again
                error = f"no generation worker serves version {version} or newer any more"
        answered = {s.question for s in samples}
        metrics = summarize(samples, c.samples_per_question, c.pass_k)
        metrics["eval/policy_version"] = float(version)
        metrics["eval/missing_questions"] = float(len(self.prompts) - len(answered))
        metrics["eval/other_version_samples"] = float(sum(s.version != version for s in samples))
        metrics["eval/seconds"] = time.monotonic() - t0
        if failures and error is None:
            error = f"{len(failures)} of {len(self.prompts)} questions failed; first: {failures[0]}"
        samples.sort(key=lambda s: s.question)
        return EvalResult(version, metrics, samples, metrics["eval/seconds"], error)

    async def _unserved(self, version: int) -> None:
        """Return once no registered generation worker serves `version` or newer (all of
        them replaced, loading an older checkpoint): the requests left could only wait. In
        a run only: `async-grpo eval`'s private workers have no registry."""
        pool = self._pools()["generation"]
        if not hasattr(pool, "connect"):
            await asyncio.Event().wait()  # never
        await pool.connect()
        while True:
            await asyncio.sleep(UNSERVED_CHECK_S)
            try:
                async with asyncio.timeout(UNSERVED_CHECK_S * 10):
                    workers = await pool.registry.status.remote()
            except TimeoutError:
                continue  # the registry is busy: check again
            if not any(w.version >= version for w in workers):
                return

    async def _question(self, q: int, prompt: Prompt, version: int) -> list[EvalSample]:
        from async_grpo.batcher.model_scores import with_model_rewards
        from async_grpo.rewards import RewardInput

        c, pools = self.cfg, self._pools()
        n = c.samples_per_question
        seed = random.Random(f"{c.seed}:{q}").getrandbits(31)  # the same at every version
        sampling = SamplingSettings(self.max_new_tokens, c.temperature, 1.0, seed)
        completions = await pools["generation"].call(
            n, "generate", prompt.input_token_ids, n, sampling, min_version=version, background=True
        )
        items = [
            RewardInput(prompt.input, x.text, prompt.answer, prompt.metadata) for x in completions
        ]

        async def by_rules() -> list[Any]:
            if not self.rules:
                return [None] * len(items)
            return await pools["verifier"].call(
                len(items), "score", items, rewards=c.rewards, evaluation=True
            )

        texts = [x.text for x in completions]
        scored = await with_model_rewards(
            self.verifier, self.models, pools, self.counters, prompt, texts, by_rules()
        )
        return [
            EvalSample(
                q,
                prompt.input,
                x.text,
                prompt.answer,
                s.reward,
                s.reward >= c.pass_threshold,
                s.reason,
                len(x.token_ids),
                x.finish_reason == "length",
                x.policy_version,
                dict(s.components),
            )
            for x, s in zip(completions, scored, strict=True)
        ]

    # -- in a run: started after a push, collected by trainer rank 0 ------------------------
    async def start(self, version: int) -> None:
        """Begin evaluating `version` in the background (returns at once)."""
        self._running[version] = asyncio.get_running_loop().create_task(self._keep(version))

    async def _keep(self, version: int) -> None:
        try:
            result = await self.evaluate(version)
        except Exception as e:  # never lost: an empty result that says why
            result = EvalResult(version, {}, [], 0.0, f"{type(e).__name__}: {e}")
        if result.error:
            print(f"evaluator: version {version}: {result.error}", flush=True)
        self._finished.append(result)
        self._running.pop(version, None)

    async def finished(self) -> list[EvalResult]:
        """The evaluations finished since the last call, oldest version first."""
        done, self._finished = sorted(self._finished, key=lambda r: r.version), []
        return done

    async def wait(self, timeout_s: float) -> list[EvalResult]:
        """Every evaluation started so far, once finished (each is bounded by its own
        timeout_s; this bound is the caller's)."""
        running = list(self._running.values())
        if running:
            await asyncio.wait(running, timeout=timeout_s)
        return await self.finished()

    async def running(self) -> list[int]:
        return sorted(self._running)


class DirectClient:
    """PoolClient's `call` over fixed actor handles, least in flight first, no registry:
    `async-grpo eval`'s private workers, which no training run can lease."""

    def __init__(self, handles: list[Any], timeout_s: float = 1800.0) -> None:
        if not handles:
            raise ValueError("DirectClient needs at least one actor handle")
        self.handles, self.timeout_s = handles, timeout_s
        self.in_flight = [0] * len(handles)

    async def call(
        self,
        n: int,
        method: str,
        *args: Any,
        min_version: int = -1,
        background: bool = False,
        **kwargs: Any,
    ) -> Any:
        i = min(range(len(self.handles)), key=self.in_flight.__getitem__)
        self.in_flight[i] += n
        try:
            ref = getattr(self.handles[i], method).remote(*args, **kwargs)
            try:
                return await asyncio.wait_for(ref, timeout=self.timeout_s)
            except TimeoutError:
                raise TimeoutError(
                    f"worker {i} did not answer {method} within {self.timeout_s:.0f}s"
                ) from None
        finally:
            self.in_flight[i] -= n
