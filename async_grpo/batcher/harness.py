"""Groups of agent-harness rollouts (`environment.kind: openai`, or a `verifiers`
environment's own rollouts, `kind: verifiers`), driven by the batcher.

The batcher's process serves the generation pool over the OpenAI API on loopback
(environments/endpoint.py); each of a group's G rollouts gets a URL of its own and runs
the user's `rollout(client, row)` in a thread of its own (environments/harness.py). Every
request of a rollout goes to the pool through the batcher's client with the group's
bounds (the oldest version it may use, a seed per sample and turn), and its tokens are
kept as the pool sampled them. When the rollout returns, its trajectory becomes samples:
one per segment (a prefix break starts a new one, `continues` set), each with the
rollout's reward. A rollout that raised, hung or returned garbage scores 0 with a counted
reason, as an environment episode does; a group in which some rollout never asked the
model for anything fails as a whole (an environment error, tried again like one).
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from async_grpo.batcher.types import ScoredSample
from async_grpo.config import RunConfig
from async_grpo.data import Prompt
from async_grpo.environments.endpoint import OpenAIEndpoint
from async_grpo.environments.harness import (
    STUCK_LIMIT,
    THREAD_SLACK_S,
    BadOutput,
    Pending,
    drive,
    load_rollout,
    reward_of,
)
from async_grpo.environments.pool import EnvironmentFailed
from async_grpo.environments.trajectory import Trajectory
from async_grpo.inference.types import SamplingSettings

LOGGED_ERRORS = 20  # distinct rollout errors printed to the log; the rest are counted


@dataclass
class _Rollout:
    """One finished rollout: its tokens, its reward (0.0 on a failure), the reason and
    first line of a failure ("" for none) and its wall time."""

    reward: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    why: str = ""
    said: str = ""
    trajectory: Trajectory | None = None
    seconds: float = 0.0
    pending: Pending | None = None  # scored with its group (score_group)


class HarnessStuck(RuntimeError):
    """Rollout threads that blocked past their timeout reached STUCK_LIMIT."""


class HarnessRunner:
    """Runs groups of rollouts of `environment.rollout` against the run's endpoint."""

    def __init__(
        self,
        cfg: RunConfig,
        clients: dict[str, Any],
        tokenizer: Any,
        rollout: tuple[Any, str] | None = None,
    ) -> None:
        e, g = cfg.environment, cfg.generation
        self.cfg, self.clients = cfg, clients
        self.rollout, self.what = rollout or harness_rollout(cfg)  # the function, its name
        self.timeout_s = e.rollout_timeout_s
        self.token = secrets.token_hex(16)
        self.endpoint = OpenAIEndpoint(
            self._generate,
            tokenizer,
            model=os.path.basename(str(cfg.model).rstrip("/")) or str(cfg.model),
            sampling=SamplingSettings(g.max_new_tokens, g.temperature, g.top_p),
            max_model_len=g.max_model_len,
            token=self.token,
            tool_parser=e.tool_parser,
            template_kwargs=dict(cfg.dataset.chat_template_kwargs),
            max_rollouts=e.max_rollouts,
            timeout_s=e.rollout_timeout_s,
        )
        self._open = asyncio.Semaphore(e.max_rollouts)
        self._threads = ThreadPoolExecutor(e.max_rollouts + STUCK_LIMIT, "rollout")
        self.stuck = 0  # rollout threads still running past their timeout
        self._stuck_lock = threading.Lock()
        self._logged: Counter[str] = Counter()

    @classmethod
    async def started(cls, cfg: RunConfig, clients: dict[str, Any]) -> HarnessRunner:
        """A runner whose endpoint listens, the model's tokenizer loaded off the loop."""
        from async_grpo.models import load_tokenizer, resolve_model

        load = lambda: load_tokenizer(resolve_model(cfg.model))  # noqa: E731
        tokenizer, rollout = await asyncio.gather(
            asyncio.to_thread(load), asyncio.to_thread(harness_rollout, cfg)
        )
        runner = cls(cfg, clients, tokenizer, rollout)
        await runner.start()
        return runner

    async def start(self) -> str:
        return await self.endpoint.start()

    async def stop(self) -> None:
        await self.endpoint.stop()
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def _generate(self, ids: list[int], n: int, sampling: SamplingSettings) -> Any:
        """The endpoint's default backend: never used, every rollout is opened with its own."""
        raise EnvironmentFailed("error", "a request outside any rollout")

    async def group(
        self,
        prompt: Prompt,
        n: int,
        sampling: SamplingSettings,
        min_version: int,
        on_retry: Any = None,
    ) -> list[ScoredSample]:
        """The samples of `n` rollouts of `prompt` (advantage 0.0: the caller sets it)."""
        runs = [
            asyncio.ensure_future(self._rollout(prompt, sampling, i, min_version, on_retry))
            for i in range(n)
        ]
        try:
            rollouts = await asyncio.gather(*runs)
        except BaseException:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            raise
        await self._score_group([r for r in rollouts if r.pending is not None])
        silent = [r for r in rollouts if not _trained(r.trajectory)]
        if silent:
            cause = next((r.said for r in silent if r.said), "it returned without asking")
            raise EnvironmentFailed(
                "error",
                f"{self.what}: a rollout made no request to the model ({cause})",
            )
        return [s for r in rollouts for s in self._samples(r, min_version)]

    async def _score_group(self, pending: list[_Rollout]) -> None:
        """The rollouts whose rewards their group gives, scored together in a thread of
        their own (within `rollout_timeout_s`); each failure counted on every one."""
        if not pending:
            return
        try:
            job = asyncio.to_thread(self.rollout.score_group, [r.pending for r in pending])
            scored = await asyncio.wait_for(job, self.timeout_s)
            for r, s in zip(pending, scored, strict=True):
                r.reward, r.parts = reward_of(s)
        except TimeoutError:
            why, said = "timeout", f"scoring the group past {self.timeout_s:g} s"
        except BadOutput as e:
            why, said = "bad_output", str(e)
        except Exception as e:
            why, said = "error", f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        else:
            return
        failed = self._failed(why, said)
        for r in pending:
            r.reward, r.parts, r.why, r.said = 0.0, {}, failed.why, failed.said

    async def _rollout(
        self, prompt: Prompt, sampling: SamplingSettings, index: int, min_version: int, on_retry
    ) -> _Rollout:
        turn = 0

        async def generate(ids: list[int], n: int, s: SamplingSettings) -> Any:
            nonlocal turn
            if s.seed is None and sampling.seed is not None:  # a seed per sample and turn
                seed = random.Random(f"{sampling.seed}:{index}:{turn}").getrandbits(31)
                s = SamplingSettings(s.max_new_tokens, s.temperature, s.top_p, seed, s.stop)
            turn += 1
            return await self.clients["generation"].call(
                1, "generate", ids, n, s, on_retry=on_retry, min_version=min_version
            )

        row = {
            "prompt": prompt.messages if prompt.messages is not None else prompt.input,
            "answer": prompt.answer,
            "metadata": dict(prompt.metadata),
            "prefill": prompt.prefill,
            "model": self.endpoint.model,
        }
        async with self._open:
            rid, url = self.endpoint.open(generate=generate)
            t0 = time.monotonic()
            try:
                out = await self._run(url, row)
            finally:
                traj = self.endpoint.close(rid)
        out.trajectory, out.seconds = traj, time.monotonic() - t0
        return out

    async def _run(self, url: str, row: dict) -> _Rollout:
        """The rollout in a thread of its own: its reward, or 0.0 and why (its trajectory
        and time are the caller's to set)."""
        job = self._threads.submit(drive, self.rollout, url, self.token, row, self.timeout_s)
        try:
            result = await asyncio.wait_for(
                asyncio.wrap_future(job), self.timeout_s + THREAD_SLACK_S
            )
            if isinstance(result, Pending):
                return _Rollout(pending=result)
            reward, parts = reward_of(result)
            return _Rollout(reward, parts)
        except TimeoutError:
            if not job.done():  # its code blocks the thread: it cannot be stopped there
                with self._stuck_lock:
                    self.stuck += 1
                job.add_done_callback(self._unstick)  # in the rollout's thread, when it ends
                if self.stuck >= STUCK_LIMIT:
                    raise HarnessStuck(
                        f"{self.what}: {self.stuck} rollouts blocked their threads past"
                        " environment.rollout_timeout_s"
                        f" ({self.timeout_s:g} s); a harness must await, not block"
                    ) from None
            return self._failed("timeout", f"past {self.timeout_s:g} s")
        except BadOutput as e:
            return self._failed("bad_output", str(e))
        except Exception as e:
            return self._failed("error", f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}")

    def _unstick(self, _: Any) -> None:
        with self._stuck_lock:
            self.stuck -= 1

    def _failed(self, why: str, said: str) -> _Rollout:
        """A failed rollout (reward 0.0); the first `LOGGED_ERRORS` distinct lines logged."""
        said = said[:200]
        if len(self._logged) < LOGGED_ERRORS and said not in self._logged:
            print(f"batcher: a rollout ended in {why}: {said}", flush=True)
        self._logged[said] += 1
        return _Rollout(why=why, said=said)

    def _samples(self, r: _Rollout, min_version: int) -> list[ScoredSample]:
        """One sample a segment of `r` (the first carries its figures; the later ones
        `continues`), each with its reward."""
        traj = r.trajectory
        assert traj is not None  # set by _rollout
        segments = [s for s in traj.segments if any(s.mask)]
        figures = {
            "turns": float(sum(s.turns for s in segments)),
            "env_errors": float(bool(r.why)),
            "prefix_breaks": float(traj.prefix_breaks),
            "rollout_s": r.seconds,
        }
        if r.why:
            figures[f"env_errors/{r.why}"] = 1.0
        out = []
        for k, seg in enumerate(segments):
            last = max(i for i, m in enumerate(seg.mask) if m) + 1  # no trailing context
            versions = [v for v, m in zip(seg.token_versions, seg.mask, strict=True) if m]
            out.append(
                ScoredSample(
                    list(seg.prompt_ids),
                    seg.ids[:last],
                    seg.logprobs[:last],
                    r.reward,
                    dict(r.parts),
                    0.0,
                    min(versions, default=min_version),
                    seg.truncated,
                    None,
                    seg.mask[:last],
                    figures if k == 0 else None,
                    token_versions=seg.token_versions[:last] if len(set(versions)) > 1 else None,
                    continues=k > 0,
                )
            )
        return out


def harness_rollout(cfg: RunConfig) -> tuple[Any, str]:
    """The run's `rollout(client, row)` and the config line that names it: the user's
    function (kind openai) or a verifiers environment's own rollout (kind verifiers)."""
    e = cfg.environment
    if e.kind == "verifiers":
        from async_grpo.environments.verifiers_env import VerifiersRollout, load_env

        return VerifiersRollout(load_env(e.name, e.args)), f"environment.name {e.name}"
    return load_rollout(e.rollout), f"environment.rollout {e.rollout}"


def _trained(traj: Trajectory | None) -> bool:
    return traj is not None and any(any(s.mask) for s in traj.segments)
