"""Multi-turn episodes for one GRPO group, driven by the batcher.

The G instances of a group are acquired together on one environment worker (all or none),
then the G episodes run concurrently, each alternating:

    generate from the accumulated ids -> environment step -> append the observation's ids

until the environment says done, the turns run out or the token budget does. The ids are
never re-tokenised: the model's tokens go in as sampled (their sampler log-probs kept,
mask True), the environment's as `TurnFormat` renders them (log-prob 0.0, mask False: the
loss treats them as context, like the prompt). An environment that raises, hangs, returns
garbage or dies ends its episode with reward 0 and a counted reason; the group is still
scored. An observation that is not valid Unicode (lone surrogates) goes in with each of
them replaced by U+FFFD, and is counted. The instances are released however the group ends.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from async_grpo.batcher.types import ScoredSample
from async_grpo.config import RunConfig
from async_grpo.data import Prompt
from async_grpo.environments import Task, get_environment
from async_grpo.environments.pool import EnvironmentFailed
from async_grpo.environments.turns import TurnFormat
from async_grpo.inference.types import PoolUnavailable, SamplingSettings
from async_grpo.text import valid_text

CALL_SLACK_S = 30.0  # a worker's own timeout fires first; this bounds a silent worker


@dataclass
class _Episode:
    """One episode as it grows: `ids` after the prompt, with mask and log-probs."""

    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per model turn
    token_versions: list[int] = field(default_factory=list)  # per token of `ids`
    reward: float = 0.0
    done: bool = False
    error: str = ""
    truncated: bool = False  # a model turn ended at its token limit, as a single completion
    turns: int = 0
    steps: int = 0
    step_s: float = 0.0
    cut_observations: int = 0
    not_unicode_observations: int = 0  # held lone surrogates, replaced by U+FFFD
    info: Counter = field(default_factory=Counter)

    def add(self, ids: list[int], logprobs: list[float] | None, versions: list[int]) -> None:
        """Append a model turn (with its log-probs) or the environment's ids (None); each
        token keeps the version that sampled it (an environment token: the last turn's)."""
        self.ids += ids
        self.mask += [logprobs is not None] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.token_versions += versions

    def mixed_versions(self) -> list[int] | None:
        """The per-token versions, or None when every model token has one version."""
        model = {v for v, m in zip(self.token_versions, self.mask, strict=True) if m}
        return self.token_versions if len(model) > 1 else None

    def figures(self) -> dict[str, float]:
        out = {
            "turns": float(self.turns),
            "env_steps": float(self.steps),
            "env_step_s": self.step_s,
            "env_errors": float(bool(self.error)),
            "observation_cut": float(self.cut_observations),
            "observation_not_unicode": float(self.not_unicode_observations),
        }
        if self.error:
            out[f"env_errors/{self.error}"] = 1.0
        return out | {f"info/{k}": float(v) for k, v in self.info.items()}


class EpisodeRunner:
    """Runs groups of episodes against the `environment` pool through `clients`."""

    def __init__(self, cfg: RunConfig, clients: dict[str, Any], turns: TurnFormat) -> None:
        e = cfg.environment
        declared = get_environment(e.name)
        self.cfg, self.clients, self.format = cfg, clients, turns
        self.max_turns = e.max_turns or declared.max_turns
        self.budget = e.max_episode_tokens or declared.max_episode_tokens
        self.timeout_s = e.step_timeout_s + CALL_SLACK_S
        self.release_failures = 0  # groups whose instances could not be released (a metric)

    async def group(
        self,
        prompt: Prompt,
        n: int,
        sampling: SamplingSettings,
        min_version: int,
        on_retry: Any = None,
    ) -> list[ScoredSample]:
        """`n` episodes of `prompt` (advantage 0.0: the caller sets it)."""
        from async_grpo.ray_utils import gone_errors

        task = Task(prompt.input, prompt.answer, dict(prompt.metadata))
        env = self.clients["environment"]
        # the instances live as long as the whole group: every turn, every step
        hold_s = self.max_turns * (env.call_timeout_s + self.timeout_s)
        async with env.hold(n, hold_s) as (worker_id, handle):
            group = uuid.uuid4().hex
            made = handle.acquire.remote([task] * n, group, hold_s + self.timeout_s)
            try:
                ids = await self._ask(made, f"acquire {n} instances")
            except gone_errors() as e:  # dead or lost: the group goes to another worker
                await env.drop(worker_id, f"died: {type(e).__name__}")
                raise PoolUnavailable(f"environment worker {worker_id} died") from None
            except BaseException:  # gave up (a timeout, a cancel): what it makes is released
                handle.drop_group.remote(group)
                raise
            runs = [
                asyncio.ensure_future(
                    self._episode(handle, iid, prompt, sampling, i, min_version, on_retry)
                )
                for i, iid in enumerate(ids)
            ]
            try:
                episodes = await asyncio.gather(*runs)
            except BaseException:  # one episode failed the group: stop its siblings first
                for run in runs:
                    run.cancel()
                await asyncio.gather(*runs, return_exceptions=True)
                raise
            finally:
                await self._release(env, worker_id, handle, ids)
        return [
            ScoredSample(
                list(prompt.input_token_ids),
                e.ids,
                e.logprobs,
                0.0 if e.error else e.reward,
                {},
                0.0,
                min(e.versions, default=min_version),
                e.truncated,
                None,
                e.mask,
                e.figures(),
                token_versions=e.mixed_versions(),
            )
            for e in episodes
        ]

    async def _ask(self, ref: Any, what: str) -> Any:
        try:
            return await asyncio.wait_for(ref, timeout=self.timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"environment worker did not {what} within {self.timeout_s:.0f}s"
            ) from None

    async def _release(self, env: Any, worker_id: str, handle: Any, ids: list[str]) -> None:
        """Release the instances, never raising (a failure would hide why the group ended)."""
        from async_grpo.ray_utils import gone_errors

        try:
            await self._ask(handle.release.remote(ids), f"release {len(ids)} instances")
        except gone_errors() as e:  # the worker died or was lost: its instances with it
            await env.drop(worker_id, f"died: {type(e).__name__}")
        except Exception as e:
            self.release_failures += 1
            print(f"batcher: releasing {len(ids)} environment instances failed: {e}", flush=True)

    async def _episode(
        self,
        handle: Any,
        instance: str,
        prompt: Prompt,
        sampling: SamplingSettings,
        index: int,
        min_version: int,
        on_retry: Any,
    ) -> _Episode:
        from async_grpo.ray_utils import gone_errors

        ep, ids = _Episode(), list(prompt.input_token_ids)
        max_len = self.cfg.generation.max_model_len
        for turn in range(self.max_turns):
            room = min(self.budget - len(ep.ids), max_len - len(ids), sampling.max_new_tokens)
            if room < 1:
                break
            seed = None
            if sampling.seed is not None:
                seed = random.Random(f"{sampling.seed}:{index}:{turn}").getrandbits(31)
            turn_sampling = SamplingSettings(room, sampling.temperature, sampling.top_p, seed)
            (c,) = await self.clients["generation"].call(
                1, "generate", ids, 1, turn_sampling, on_retry=on_retry, min_version=min_version
            )
            sampled = c.token_versions or [c.policy_version] * len(c.token_ids)
            ep.add(c.token_ids, c.logprobs, sampled)
            ids += c.token_ids
            ep.truncated |= c.finish_reason == "length"
            ep.versions.append(c.policy_version)
            ep.turns += 1
            t0 = time.monotonic()
            try:
                result = await self._ask(handle.step.remote(instance, c.text), "step")
            except EnvironmentFailed as e:
                ep.error = e.reason
            except TimeoutError:
                ep.error = "timeout"
            except gone_errors():
                ep.error = "died"
            ep.steps += 1
            ep.step_s += time.monotonic() - t0
            if ep.error:
                break
            ep.reward += result.reward
            ep.info.update(result.info)
            if result.done:
                ep.done = True
                break
            if turn + 1 == self.max_turns:
                break
            observation, replaced = valid_text(result.observation)
            ep.not_unicode_observations += bool(replaced)
            between, cut = self.format.between(observation, self.format.closed(c.token_ids))
            ep.cut_observations += cut
            if len(ep.ids) + len(between) >= self.budget or len(ids) + len(between) >= max_len:
                break  # no room left for another model turn
            ep.add(between, None, [ep.versions[-1]] * len(between))
            ids += between
        return ep


def turn_format(cfg: RunConfig) -> TurnFormat:
    """The run's TurnFormat, from the model's tokenizer and the ids its engine stops on."""
    from async_grpo.models import load_tokenizer, resolve_model

    model_dir = resolve_model(cfg.model)
    tokenizer = load_tokenizer(model_dir)
    return TurnFormat(tokenizer, cfg.environment.max_observation_tokens, stop_ids(model_dir))


def stop_ids(model_dir: Any) -> list[int]:
    """The EOS ids of the model's `generation_config.json` (vLLM stops on each)."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])
