"""ExperienceBatcher: prompts in, per-rank token-budgeted minibatches out.

For step s it draws `questions_per_step` prompts (global draws s*q .. s*q+q-1 of the seeded
sampler, so a resumed run sees the same prompts), asks the generation pool for groups of
`samples_per_question`, scores them, computes group advantages, adds reference log-probs
when the KL penalty is on, and streams rounds of minibatches to the trainer ranks while the
rest of the batch is still generating. Generation for step s starts once the workers serve
policy version >= s - max_off_policy_steps: that is the one place the staleness bound is
enforced (a group that still comes back staler is regenerated and counted).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from typing import Any

import torch

from async_grpo.batcher.channel import Channel, ChannelClosed
from async_grpo.batcher.rounds import fill_round, split_group
from async_grpo.batcher.types import EndOfBatch, Minibatch, ScoredSample
from async_grpo.config import RunConfig
from async_grpo.core.advantages import group_advantages
from async_grpo.core.packing import packed_tokens, plan_minibatches
from async_grpo.data import Prompt, PromptSampler
from async_grpo.inference.types import PoolUnavailable, RequestError, SamplingSettings

GROUP_ATTEMPTS = 3
POOL_STATS_TIMEOUT_S = 60.0


class ExperienceBatcher:
    """Runs as a named Ray actor; `clients` maps pool name -> PoolClient (injected in tests)."""

    def __init__(
        self,
        cfg: RunConfig,
        prompts: list[Prompt],
        num_ranks: int,
        clients: dict[str, Any] | None = None,
    ) -> None:
        from async_grpo.logs import to_file

        to_file()  # a quiet run: this actor's output to OUTPUT_DIR/logs/batcher.log
        if any(p.input_token_ids is None for p in prompts):
            raise ValueError("ExperienceBatcher needs tokenized prompts (input_token_ids)")
        self.cfg, self.prompts, self.num_ranks = cfg, prompts, num_ranks
        self.sampler = PromptSampler(len(prompts), cfg.batcher.seed)
        self._clients = clients
        self.version = -1
        self._version_changed: asyncio.Condition | None = None
        self.channel = Channel(list(range(num_ranks)), 4 * cfg.batcher.max_tokens_per_gpu)
        self._ready: dict[int, asyncio.Queue] = defaultdict(asyncio.Queue)
        self._tasks: list[asyncio.Task] = []
        self.counters: dict[str, float] = defaultdict(float)  # packing, over the run
        self.drops: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.error: str | None = None
        loss = cfg.trainer.loss
        # all-equal rewards give all-zero advantages; with no KL and no entropy term such a
        # sample's loss gradient is exactly 0, so it is counted in the normaliser only
        self._skip_zero = (
            cfg.batcher.skip_zero_advantage and loss.kl_coef == 0 and loss.entropy_coef == 0
        )

    # -- control, called by trainer rank 0 ------------------------------------------------
    async def start(self, start_step: int) -> None:
        from async_grpo.inference.client import PoolClient

        if self._clients is None:
            pools = ["generation", "verifier"] + (["logprob"] if self._kl else [])
            self._clients = {p: PoolClient(p) for p in pools}
            # a pool with no registry fails the start, not each group as a counted drop
            await asyncio.gather(*(c.connect() for c in self._clients.values()))
        self._version_changed = asyncio.Condition()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._guard(self._produce(start_step))),
            loop.create_task(self._guard(self._emit(start_step))),
        ]

    async def set_version(self, version: int) -> None:
        async with self._version_changed:
            self.version = version
            self._version_changed.notify_all()

    async def get(self, rank: int, timeout_s: float) -> Minibatch | EndOfBatch:
        """The next item for `rank`: minibatches of the current step, then its EndOfBatch."""
        if self.error:
            raise RuntimeError(f"batcher failed: {self.error}")
        try:
            (item,) = await self.channel.get_batch(rank, 1, timeout_s)  # weights are >= 1
        except ChannelClosed:  # closed by a failure (or a stop): say which
            raise RuntimeError(f"batcher failed: {self.error or 'stopped'}") from None
        except TimeoutError:
            raise TimeoutError(
                f"rank {rank} waited {timeout_s:.0f}s for a minibatch from the"
                f" batcher ({self.error or 'generation still running'})"
            ) from None
        return item

    async def stop(self) -> None:
        """Cancel every producing task and wait for them, so their leases are released."""
        tasks = [t for t in self._tasks if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=60)
        await self.channel.close()

    @property
    def _kl(self) -> bool:
        return self.cfg.trainer.loss.kl_coef > 0

    async def _guard(self, coro: Any) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as e:  # surfaced to every rank through get()
            self.error = f"{type(e).__name__}: {e}"
            await self.channel.close()
            raise

    # -- producing groups -----------------------------------------------------------------
    async def _produce(self, start_step: int) -> None:
        b = self.cfg.batcher
        step = start_step
        while step < self.cfg.trainer.max_steps:
            async with self._version_changed:
                await self._version_changed.wait_for(
                    lambda s=step: self.version >= s - b.max_off_policy_steps
                )
            self._tasks = [t for t in self._tasks if not t.done()]  # keep the list short
            for slot in range(b.questions_per_step):
                self._tasks.append(
                    asyncio.get_running_loop().create_task(self._guard(self._group(step, slot)))
                )
            step += 1

    async def _group(self, step: int, slot: int) -> None:
        b, g = self.cfg.batcher, self.cfg.generation
        prompt = self.prompts[self.sampler.index_at(step * b.questions_per_step + slot)]
        for attempt in range(GROUP_ATTEMPTS):
            seed = random.Random(f"{b.seed}:{step}:{slot}:{attempt}").getrandbits(31)
            sampling = SamplingSettings(g.max_new_tokens, g.temperature, g.top_p, seed)
            try:
                group = await self._make_group(step, prompt, sampling)
            except RequestError as e:  # this prompt is bad; the run goes on without it
                self.drops[step]["dropped/bad_request"] += 1
                print(f"batcher: step {step} slot {slot}: {e}", flush=True)
                break
            except (PoolUnavailable, TimeoutError) as e:
                self.drops[step]["dropped/group_error"] += 1
                print(f"batcher: step {step} slot {slot} attempt {attempt}: {e}", flush=True)
                continue
            if group is not None:
                await self._ready[step].put(group)
                return
        await self._ready[step].put(None)  # the batch goes on without this group (counted)

    async def _make_group(
        self, step: int, prompt: Prompt, sampling: SamplingSettings
    ) -> list[ScoredSample] | None:
        from async_grpo.rewards import RewardInput

        n, ids = self.cfg.batcher.samples_per_question, prompt.input_token_ids
        completions = await self._clients["generation"].call(n, "generate", ids, n, sampling)
        version = min(c.policy_version for c in completions)
        if step - version > self.cfg.batcher.max_off_policy_steps:
            self.drops[step]["dropped/stale"] += n
            return None
        scored = await self._clients["verifier"].call(
            n,
            "score",
            [
                RewardInput(prompt.input, c.text, prompt.answer, prompt.metadata)
                for c in completions
            ],
        )
        rewards = torch.tensor([s.reward for s in scored], dtype=torch.float32)  # [n]
        adv, zero = group_advantages(rewards, self.cfg.trainer.loss.advantage_std_norm)
        refs: list[Any] = [None] * n
        if self._kl:
            refs = await self._clients["logprob"].call(
                n, "logprobs", [(ids, c.token_ids) for c in completions]
            )
        return [
            ScoredSample(
                ids,
                c.token_ids,
                c.logprobs,
                s.reward,
                s.components,
                float(a),
                c.policy_version,
                c.finish_reason == "length",
                r,
            )
            for c, s, a, r in zip(completions, scored, adv.tolist(), refs, strict=True)
        ]

    # -- emitting rounds --------------------------------------------------------------------
    async def _emit(self, start_step: int) -> None:
        b = self.cfg.batcher
        budget = b.max_tokens_per_gpu
        step = start_step
        while step < self.cfg.trainer.max_steps:
            t0 = time.monotonic()
            buffer: list[list[ScoredSample]] = []  # packing units: samples that go together
            groups: list[list[ScoredSample]] = []
            skipped: list[ScoredSample] = []
            passes = 0
            for _ in range(b.questions_per_step):
                group = await self._ready[step].get()
                if group is None:
                    continue
                groups.append(group)
                if self._skip_zero and all(s.advantage == 0.0 for s in group):
                    skipped += group
                    continue
                lens = [len(s.completion_ids) for s in group]
                units = split_group(len(group[0].prompt_ids), lens, budget, b.share_prompts)
                buffer += [[group[i] for i in unit] for unit in units]
                while (
                    bins := fill_round([self._tokens(u) for u in buffer], self.num_ranks, budget)
                ) is not None:
                    await self._send_round(step, [_flat(buffer, bin_) for bin_ in bins])
                    taken = {i for bin_ in bins for i in bin_}
                    buffer = [u for i, u in enumerate(buffer) if i not in taken]
                    passes += 1
            plan = plan_minibatches([self._tokens(u) for u in buffer], budget, self.num_ranks)
            for k in range(len(plan[0])):
                await self._send_round(
                    step, [_flat(buffer, plan[r][k]) for r in range(self.num_ranks)]
                )
                passes += 1
            del self._ready[step]
            samples = [s for grp in groups for s in grp]
            stats = self._batch_stats(step, groups, time.monotonic() - t0)
            stats |= await self._pool_counters()
            tokens, count = self._loss_counts(samples)
            skip_tokens, skip_count = self._loss_counts(skipped)
            stats["skipped_samples"] = float(len(skipped))
            for r in range(self.num_ranks):
                eob = EndOfBatch(step, tokens, count, passes, stats, skip_tokens, skip_count)
                await self.channel.put(r, eob, 1, timeout_s=3600)
            step += 1

    async def _pool_counters(self) -> dict[str, float]:
        """Counters kept by the pools since the start: verifier timeouts and errors (summed
        over the verifier workers) and requests retried after a worker died."""
        out = {
            f"pool/{name}_retries": float(getattr(c, "retries", 0))
            for name, c in self._clients.items()
        }
        registry = getattr(self._clients["verifier"], "registry", None)
        if registry is None:
            return out
        try:
            async with asyncio.timeout(POOL_STATS_TIMEOUT_S):
                handles = await registry.handles.remote()
                per_worker = await asyncio.gather(*(h.stats.remote() for h in handles.values()))
        except TimeoutError:
            print(
                f"batcher: verifier stats not answered within {POOL_STATS_TIMEOUT_S:.0f}s;"
                " this step's verifier counters are left out",
                flush=True,
            )
            return out
        for key in ("verifier/timeouts", "verifier/errors", "verifier/scored"):
            out[key] = float(sum(w.get(key, 0) for w in per_worker))
        return out

    def _tokens(self, samples: list[ScoredSample]) -> int:
        """Row tokens of `samples` once packed (prompts shared within a group when on)."""
        return packed_tokens(samples, self.cfg.batcher.share_prompts)

    async def _send_round(self, step: int, bins: list[list[ScoredSample]]) -> None:
        for rank, samples in enumerate(bins):
            tokens = self._tokens(samples)
            self.counters["packed_tokens"] += tokens
            self.counters["packed_budget"] += self.cfg.batcher.max_tokens_per_gpu
            mb = Minibatch(step, [s.to_pack_input() for s in samples], tokens)
            await self.channel.put(rank, mb, max(tokens, 1), timeout_s=3600)

    def _loss_counts(self, samples: list[ScoredSample]) -> tuple[int, int]:
        kept = [
            s
            for s in samples
            if not (self.cfg.trainer.loss.mask_truncated and s.truncated) and s.completion_ids
        ]
        return sum(len(s.completion_ids) for s in kept), len(kept)

    def _batch_stats(
        self, step: int, groups: list[list[ScoredSample]], wait_s: float
    ) -> dict[str, float]:
        samples = [s for g in groups for s in g]
        if not samples:
            return {"samples": 0.0, **self._drain_counters(step)}
        mean = lambda xs: float(sum(xs) / len(xs)) if xs else 0.0  # noqa: E731
        stats = {
            "samples": float(len(samples)),
            "reward/mean": mean([s.reward for s in samples]),
            "reward/max_in_group_mean": mean([max(s.reward for s in g) for g in groups]),
            "output_length/mean": mean([len(s.completion_ids) for s in samples]),
            "truncated_fraction": mean([float(s.truncated) for s in samples]),
            "zero_advantage_fraction": mean(
                [float(len({s.reward for s in g}) == 1) for g in groups]
            ),
            "staleness/mean": mean([step - s.version for s in samples]),
            "staleness/max": float(max(step - s.version for s in samples)),
            "time/batch_assembly": wait_s,
        }
        for key in sorted({k for s in samples for k in s.components}):
            stats[f"reward/{key}"] = mean([s.components.get(key, 0.0) for s in samples])
        return stats | self._drain_counters(step)

    def _drain_counters(self, step: int) -> dict[str, float]:
        """The drops of `step`'s groups (every group of the step has reported by now) and
        the run's packing efficiency so far."""
        out = dict(self.drops.pop(step, {}))
        budget = self.counters.get("packed_budget", 0.0)
        if budget:
            out["packing_efficiency"] = self.counters["packed_tokens"] / budget
        return out


def _flat(units: list[list[ScoredSample]], picked: list[int]) -> list[ScoredSample]:
    """The samples of the picked units, each unit's samples kept together."""
    return [s for i in picked for s in units[i]]
