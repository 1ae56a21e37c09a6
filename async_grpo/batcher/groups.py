"""One scored group: samples from the generation pool (or episodes from the environment
pool), their rewards, group advantages and, with the KL penalty on, reference log-probs.

In: a prompt's index, the step and slot it is for (which fix the sampling seeds), the
pools. Out: `samples_per_question` ScoredSamples, or None; every failed try is counted in
the step's books (`samples/*`, `dropped/*`), so the books balance whatever happens.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from async_grpo.batcher.single_turn import single_turn_group
from async_grpo.batcher.stats import attempt_failure
from async_grpo.batcher.types import ScoredSample
from async_grpo.config import RunConfig
from async_grpo.core.advantages import group_advantages
from async_grpo.data import Prompt
from async_grpo.environments.pool import EnvironmentFailed
from async_grpo.inference.types import PoolUnavailable, RequestError, SamplingSettings
from async_grpo.rewards.overlong import overlong_penalty

GROUP_ATTEMPTS = 3


@dataclass
class GroupMaker:
    """Makes groups for the batcher; the dicts are the batcher's, shared (per step: the
    books, the scoring failures, the scoring spans of the timeline and what the failed
    attempts said: cause -> the workers that said it)."""

    cfg: RunConfig
    prompts: list[Prompt]
    clients: dict[str, Any]
    episodes: Any  # an EpisodeRunner in an environment run, else None
    books: dict[int, dict[str, float]]
    score_failures: dict[int, list[Any]]
    score_spans: dict[int, list[dict]]
    kl: bool  # the KL penalty is on: each group gets reference log-probs
    group_failures: dict[int, dict[str, set[str]]] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # the run's

    async def find(
        self, step: int, slot: int, index: int, attempts: int = GROUP_ATTEMPTS
    ) -> list[ScoredSample] | None:
        """A scored group of prompt `index` for `step`, in up to `attempts` tries; every
        failed try is counted as a drop (a spare group has one try)."""
        b, g = self.cfg.batcher, self.cfg.generation
        prompt = self.prompts[index]
        books, n = self.books[step], b.samples_per_question
        for attempt in range(attempts):
            seed = random.Random(f"{b.seed}:{step}:{slot}:{attempt}").getrandbits(31)
            sampling = SamplingSettings(g.max_new_tokens, g.temperature, g.top_p, seed)
            books["samples/requested"] += n
            if attempt:
                books["samples/regenerated"] += n
            try:
                group = await self.make(step, prompt, sampling)
            except RequestError as e:  # this prompt is bad; the run goes on without it
                books["dropped/bad_request"] += n
                print(f"batcher: step {step} slot {slot}: {e}", flush=True)
                break
            except (PoolUnavailable, TimeoutError, EnvironmentFailed) as e:
                books["dropped/group_error"] += n
                cause, worker = attempt_failure(e)
                self.group_failures.setdefault(step, {}).setdefault(cause, set()).add(worker)
                at = f" (worker {worker})" if worker else ""
                print(
                    f"batcher: step {step} slot {slot} attempt {attempt}: {cause}{at}", flush=True
                )
                continue
            if group is not None:
                for s in group:
                    s.prompt_index = index
                return group
        return None  # the batch goes on without this group (counted)

    async def make(
        self, step: int, prompt: Prompt, sampling: SamplingSettings
    ) -> list[ScoredSample] | None:
        """A scored group of `prompt` with its advantages (and reference log-probs when the
        KL penalty is on); None when it came back staler than the bound."""
        n, k = self.cfg.batcher.samples_per_question, self.cfg.batcher.max_off_policy_steps
        books = self.books[step]

        def reissued() -> None:  # the request went to another worker after a death
            books["samples/reissued"] += n

        if self.episodes is not None:
            group = await self.episodes.group(prompt, n, sampling, step - k, reissued)
            books["samples/generated"] += n
            books["samples/scored"] += n
            if step - min(s.version for s in group) > k:
                books["dropped/stale"] += n
                return None
            failed = any(s.episode and s.episode["env_errors"] for s in group)
            if failed and self.cfg.environment.on_error == "regenerate":
                books["dropped/env_error"] += n
                return None
        else:
            group = await single_turn_group(
                self.cfg,
                self.clients,
                books,
                self.score_failures[step],
                prompt,
                sampling,
                step,
                reissued,
                self.score_spans[step],
                self.counters,
            )
        if group is None:
            return None
        overlong = self.cfg.verifier.overlong
        if overlong.buffer and self.episodes is None:
            for s in group:  # DAPO's soft penalty, before the advantages
                s.components["overlong"] = overlong_penalty(
                    len(s.completion_ids), self.cfg.generation.max_new_tokens, overlong
                )
                s.reward += s.components["overlong"]
        # one advantage a rollout: its later segments (a harness's prefix breaks) share it
        heads = [s for s in group if not s.continues]
        rewards = torch.tensor([s.reward for s in heads], dtype=torch.float32)  # [n]
        adv, _ = group_advantages(rewards, self.cfg.trainer.loss.advantage_std_norm)
        of_rollout = [-1]
        for s in group:
            of_rollout.append(of_rollout[-1] + (not s.continues))
        refs: list[Any] = [None] * len(group)
        if self.kl:
            refs = await self.clients["logprob"].call(
                len(group),
                "logprobs",
                [(s.prompt_ids, s.completion_ids) for s in group],
                on_retry=reissued,
            )
        for s, j, r in zip(group, of_rollout[1:], refs, strict=True):
            s.advantage, s.ref_logprobs = float(adv[j]), r
        return group
