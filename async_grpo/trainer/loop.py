"""The trainer process (one per torchrun rank): pull minibatches, step, push, checkpoint.

How it departs from the GRPO paper: the loss of each minibatch is the plain sum of its
per-token terms, and the gradient is divided by the step's global count (loss tokens or
samples, all-reduced over ranks) just before the optimizer step. That is exactly the
whole-batch gradient, and it lets minibatches stream in before the batch is complete.
Samples may be up to `max_off_policy_steps` policy versions old (truncated importance
sampling corrects for it); with 0 it is on-policy GRPO.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from async_grpo.batcher.stats import check_lost_groups
from async_grpo.batcher.types import EndOfBatch, PushNow
from async_grpo.config import RunConfig
from async_grpo.core.loss import build_loss, loss_counts, loss_weight_mask, summarize_metrics
from async_grpo.core.packing import pack
from async_grpo.errors import UserError
from async_grpo.faults import fault_point
from async_grpo.hooks import HookContext, Hooks
from async_grpo.timeline import SpanLog
from async_grpo.trainer.books import StepBooks, reduce_books
from async_grpo.trainer.push import rank0_decides
from async_grpo.trainer.updates import several_updates

# the trainer's idle time in a step: waiting for samples, for generation before a push
# (the fixed lag), and for an evaluation of the old version before a push
IDLE_KEYS = ("time/wait", "time/wait_generated", "time/hooks_before_push")
# the step's timings that _accumulate sums, kept in its metrics row
ACCUMULATED_TIMINGS = (
    "time/wait",
    "time/forward_backward",
    "time/reference",  # LoRA with a KL term: the base's log-probs, adapters off
    "weight_catch_up_pushes",
    "time/weight_catch_up",
)


class Trainer:
    """One torchrun rank: `step` runs every minibatch the batcher sends this rank, then
    one optimizer step. Rank 0 also pushes weights and writes metrics (`pusher`,
    `writer`, `bar`, attached by `build_trainer`)."""

    def __init__(
        self,
        cfg: RunConfig,
        policy: Any,
        opt: Any,
        sched: Any,
        batcher: Any,
        model_dir: str,
        device: torch.device,
    ) -> None:
        self.cfg, self.policy, self.opt, self.sched = cfg, policy, opt, sched
        self.batcher, self.model_dir, self.device = batcher, model_dir, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.loss_fn = build_loss(cfg.trainer.loss, cfg.generation.max_new_tokens)
        self.updates_per_batch = cfg.trainer.mini_batches * cfg.trainer.epochs
        self.start = 0
        self.samples_seen = 0  # samples trained on (with a loss token), over all steps
        self.pending: dict[int, Any] = {}  # groups a checkpoint kept for the next steps
        self.curriculum: dict[str, Any] | None = None  # a checkpoint's mastery table
        self.attention_reason = ""
        self.pusher: Any = None
        self.resumed_hf: str | None = None  # the checkpoint this run resumed from
        self.writer: Any = None
        self.timeline: Any = None  # rank 0's TimelineWriter
        self.spans = SpanLog("trainer")
        self.bar: Any = None
        self.hooks = Hooks([])  # rank 0's (build_trainer): eval, sample log, the user's
        self.hook_ctx: HookContext | None = None  # rank 0's, given to every hook
        self.log_dir: Any = None  # OUTPUT_DIR/logs in a quiet run
        self.final_push = False  # push the final weights too (a hook evaluates them)
        self.t_start = time.perf_counter()
        self.rewards: list[float] = []  # rank 0: each step's mean training reward
        self.stopped_at: int | None = None  # the step trainer.stop_at_reward ended the run at

    def resume(self, path: Any) -> None:
        """Restore model, optimizer, schedule and counters from a checkpoint (collective)."""
        from async_grpo.trainer import checkpoint

        info = checkpoint.load(path, self.policy, self.opt, self.sched)
        self.resumed_hf = str(checkpoint.weights_dir(path))
        self.start = int(info["step"])
        self.samples_seen = int(info.get("samples_seen", 0))
        if self.rank == 0:
            self.pending = checkpoint.load_pending(path)
            self.curriculum = info.get("curriculum")

    def run(self) -> None:
        self.t_start = time.perf_counter()
        self.final_push = rank0_decides(self.hooks.wants_final_push)
        if self.rank == 0:  # a late joiner must not load another run's checkpoint
            self.pusher.announce_checkpoint(self.start, self.resumed_hf)
            ctx = HookContext(self.cfg, Path(self.cfg.output_dir), self.model_dir, self.writer.log)
            ctx.last_version = self.cfg.trainer.max_steps
            self.hook_ctx = ctx
            ctx.hooks, ctx.extra["log_dir"] = self.hooks, self.log_dir
            self.hooks.call("on_start", ctx)
        try:
            self._steps()
        except BaseException:  # an error, or SystemExit from Ray's SIGTERM handler
            self.pusher.remove_weight_file()
            raise
        self.pusher.close()  # the shared-memory slots, the broadcast group
        if self.rank == 0:
            self.batcher.stop()
            self.writer.close()
            self.bar.close()
        dist.barrier()
        dist.destroy_process_group()

    def _steps(self) -> None:
        self.pusher.push(self.start)  # the workers serve exactly the weights step `start` trains
        if self.rank == 0:
            from tqdm import tqdm

            self.hooks.call("after_push", self.start)
            self._write_params()
            total = self.cfg.trainer.max_steps
            self.bar = tqdm(total=total, initial=self.start, desc="steps", dynamic_ncols=True)
            self.batcher.start(self.start, self.pending, self.curriculum)
            self.batcher.set_version(self.start)
        for step in range(self.start, self.cfg.trainer.max_steps):
            self.step(step)
            if self.stopped_at is not None:
                if self.rank == 0:
                    print(f"trainer.stop_at_reward reached at step {step + 1}", flush=True)
                break
        if self.rank == 0:
            self.hooks.call("on_end")

    def _write_params(self) -> None:
        """training_params.json: the config, and what `auto` resolved to in each process."""
        p = self.policy
        resolved = {
            "trainer_compute_dtype": p.precision.describe(),
            "trainer_attention": f"{p.attention.name} ({self.attention_reason})",
            "trainer_activation_checkpointing": p.checkpointing,
            "generation_dtype": self.pusher.worker_dtypes,
            "weight_push_dtype": self.pusher.wire_dtype,
            "weight_transports": self.pusher.transports,
        }
        extra = {"world_size": self.world, "resumed_from": self.start, "resolved": resolved}
        self.writer.write_params(asdict(self.cfg) | extra)
        print(
            "precision: trainer computes in {trainer_compute_dtype}; generation workers"
            " {generation_dtype}; attention {trainer_attention}".format(**resolved),
            flush=True,
        )

    def _accumulate(self, step: int) -> tuple[EndOfBatch, dict[str, Any]]:
        """Forward/backward every minibatch of the step; returns its EndOfBatch and sums."""
        acc: dict[str, Any] = {
            "sums": defaultdict(float),
            "passes": 0,
            "reduce_passes": 0,
            "tokens": 0,
            "counts": [0, 0],
            "received": 0,  # samples in this rank's minibatches, with a loss token or not
            "time/wait": 0.0,
            "time/forward_backward": 0.0,
            "time/reference": 0.0,
            "weight_catch_up_pushes": 0,
            "time/weight_catch_up": 0.0,
        }
        mask_truncated = self.cfg.trainer.loss.mask_truncated
        defer = self.cfg.trainer.defer_grad_sync and self.world > 1
        base_kl = self.cfg.reference == "base"
        unreduced = False  # a backward ran without reducing its gradients
        acc["kept"] = []  # several updates per batch: (part, batch) of every round, in order
        while True:
            tw, wall = time.perf_counter(), time.time()
            item = self.batcher.next()
            acc["time/wait"] += time.perf_counter() - tw
            self.spans.add("wait", wall, time.time())
            if isinstance(item, PushNow):
                self._catch_up(step, acc)
                continue
            if isinstance(item, EndOfBatch):
                if unreduced:  # the last round was streamed, so not marked: reduce now
                    self._reduce_pass()
                    acc["reduce_passes"] = 1
                return item, acc
            tf, wall = time.perf_counter(), time.time()
            batch = pack(item.samples, share_prompts=self.cfg.batcher.share_prompts)
            batch = self.policy.attention.prepare(batch).to(self.device)
            if base_kl:
                tr = time.perf_counter()
                batch.ref_logprobs = self._base_logprobs(batch)
                acc["time/reference"] += time.perf_counter() - tr
            if self.updates_per_batch > 1:  # the updates run once the batch is whole
                if self.cfg.trainer.loss.proximal == "current":
                    with torch.no_grad():  # the policy before the batch's first update
                        old, _ = self.policy(batch, True)
                    batch.old_logprobs = old.detach().masked_fill(~batch.loss_mask, 0.0)
                acc["kept"].append((item.part, batch))
            else:
                if defer:  # the same on every rank: rounds and their `last` are
                    self.policy.set_requires_gradient_sync(item.last)
                    unreduced = not item.last
                self.forward_backward(batch, acc["sums"])
            tokens, samples = loss_counts(batch, mask_truncated)
            acc["counts"][0] += tokens
            acc["counts"][1] += samples
            acc["passes"] += 1
            acc["received"] += len(item.samples)
            acc["tokens"] += item.num_tokens
            acc["time/forward_backward"] += time.perf_counter() - tf
            self.spans.add("train", wall, time.time())

    def forward_backward(self, batch: Any, sums: dict[str, float]) -> None:
        """The loss of one minibatch (a plain sum, normalised at the update) backwards, its
        metric sums added to `sums`."""
        use_entropy = bool(self.cfg.trainer.loss.entropy_coef)
        logp, ent = self.policy(batch, True)
        loss, m = self.loss_fn(logp, batch, 1, 1, ent if use_entropy else None, 1)
        loss.backward()
        if not use_entropy:  # the loss sums it when it uses it; the metric always
            mask = loss_weight_mask(batch, self.cfg.trainer.loss.mask_truncated)
            m["entropy_sum"] = ent.detach()[mask].sum()
        m["loss_total"] = loss.detach()
        for k, v in m.items():
            if k.endswith("_max"):  # a maximum, not a sum
                sums[k] = max(sums.get(k, float("-inf")), float(v))
            else:
                sums[k] += float(v)

    def _base_logprobs(self, batch: Any) -> torch.Tensor:
        """The reference log-probs under LoRA: the frozen base's, from the same policy with
        its adapters switched off (no second model, no logprob pool)."""
        from async_grpo.trainer.lora import adapters_off

        with torch.no_grad(), adapters_off(self.policy.hf):
            ref, _ = self.policy(batch, False)  # [T]
        return ref.float().masked_fill(~batch.loss_mask, 0.0)

    def _catch_up(self, step: int, acc: dict[str, Any]) -> None:
        """A PushNow (every rank gets it between the same two minibatches): push the
        weights held now, which are version `step` (no optimizer step has run since), if
        rank 0 still finds a worker behind it; the up-to-date workers reload the same
        version. Gradients accumulated so far are untouched."""
        behind = self.pusher.behind(step) if self.rank == 0 else []
        if not rank0_decides(bool(behind)):
            return
        t = time.perf_counter()
        if self.rank == 0:
            print(f"weight push {step}: catching up {behind}", flush=True)
        with self.spans.span("push"):
            self.pusher.push(step)
        if self.rank == 0:
            self.batcher.set_version(step)
        acc["weight_catch_up_pushes"] += 1
        acc["time/weight_catch_up"] += time.perf_counter() - t

    def _reduce_pass(self) -> None:
        """A zero-loss pass of one padding token with gradient sync on: its backward
        reduces the gradients the step's unsynced backwards accumulated."""
        batch = self.policy.attention.prepare(pack([])).to(self.device)
        self.policy.set_requires_gradient_sync(True)
        logp, _ = self.policy(batch, False)
        (logp.sum() * 0.0).backward()

    def step(self, step: int) -> dict[str, Any]:
        """One optimizer step over everything the batcher sends for `step`, in its phases:
        accumulate, reduce and check the books, optimize, then push and save as due, and
        record. Returns the step's metrics (the same on every rank, written by rank 0)."""
        t0 = time.perf_counter()
        if self.rank == 0:
            self.hooks.call("before_step", step)
        eob, acc = self._accumulate(step)
        fault_point("trainer.step")  # the fault suite's trainer crash: after fwd/bwd
        to, wall = time.perf_counter(), time.time()
        if self.updates_per_batch > 1:
            grad_norm, lr = several_updates(self, acc, eob)
            books = reduce_books(acc, eob, step, self.rank, self.loss_fn.aggregation_name)
        else:
            books = reduce_books(acc, eob, step, self.rank, self.loss_fn.aggregation_name)
            grad_norm, lr = self.optimize(books.denom)
        self.spans.add("train", wall, time.time())
        self.samples_seen += books.samples
        timings = {k: float(acc[k]) for k in ACCUMULATED_TIMINGS}
        timings["time/optimizer"] = time.perf_counter() - to
        if self._reached_target(eob):
            self.stopped_at = step + 1
            if self.rank == 0:  # the hooks see the run's last version before its push
                self.hook_ctx.last_version = self.stopped_at
        timings |= self._push_and_save(step + 1)
        record = self._record(step + 1, t0, acc, books, eob, grad_norm, lr, timings)
        self._report(step, record, eob)
        return record

    def optimize(self, denom: int) -> tuple[float, float]:
        """Scale the summed gradients to the step's mean, clip, step; (grad norm, lr)."""
        from async_grpo.trainer.model import scale_grads

        if denom:
            scale_grads(self.policy, self.world / denom)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.policy.parameters(), self.cfg.trainer.grad_clip
        )
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = self.sched.get_last_lr()[0]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return float(grad_norm), lr

    def _reached_target(self, eob: EndOfBatch) -> bool:
        """`trainer.stop_at_reward`: whether the mean training reward of the last
        `stop_window` steps (of this run, a resumed one counting afresh) reached it; rank 0
        reads it, every rank gets its answer (a collective)."""
        t = self.cfg.trainer
        if t.stop_at_reward is None:
            return False
        reached = False
        if self.rank == 0:
            self.rewards.append(float(eob.stats.get("reward/mean", 0.0)))
            last = self.rewards[-t.stop_window :]
            reached = len(last) == t.stop_window and sum(last) / len(last) >= t.stop_at_reward
        return rank0_decides(reached)

    def _push_and_save(self, done: int) -> dict[str, float]:
        """Version `done` is trained: push it and save it where due; their timings."""
        from async_grpo.trainer.model import full_state_dict

        t, timings = self.cfg.trainer, {}
        last = done == t.max_steps or done == self.stopped_at
        save = bool(t.save_every and done % t.save_every == 0) or last
        push = (done % t.push_every == 0 and not last) or (last and self.final_push)
        state = full_state_dict(self.policy) if save else {}
        pending = None
        # fixed lag: no step is generated by two versions. In-flight updates drop it before
        # a push (running requests go on under the new weights) but keep it before a save,
        # so a checkpoint still holds whole steps and a resumed run trains the same samples.
        in_flight = self.cfg.generation.weight_update == "in_flight"
        fixed_lag = save or (push and not in_flight)
        if fixed_lag and self.rank == 0 and self.cfg.batcher.max_off_policy_steps:
            tg = time.perf_counter()
            with self.spans.span("wait"):
                self.batcher.wait_generated()
            timings["time/wait_generated"] = time.perf_counter() - tg
            pending = self.batcher.pending(done) if save else None
        if push:
            timings |= self._push(done)
        if save:
            ts, wall = time.perf_counter(), time.time()
            self._save(done, state, pending)
            timings["time/checkpoint"] = time.perf_counter() - ts
            self.spans.add("save", wall, time.time())
        return timings

    def _push(self, done: int) -> dict[str, float]:
        """A collective: every rank gathers, rank 0 sends (after the evaluation of the
        version it replaces)."""
        timings = {}
        if self.rank == 0:
            th = time.perf_counter()
            with self.spans.span("hooks"):
                self.hooks.call("before_push", done)
            timings["time/hooks_before_push"] = time.perf_counter() - th
        with self.spans.span("push"):
            timings |= self.pusher.push(done)
        if self.rank == 0:
            self.batcher.set_version(done)
            self.hooks.call("after_push", done)
        return timings

    def _save(self, done: int, state: dict[str, Any], pending: Any) -> None:
        from async_grpo.trainer import checkpoint

        counters: dict[str, Any] = {"samples_seen": self.samples_seen}
        if self.rank == 0 and self.cfg.batcher.curriculum:
            counters["curriculum"] = self.batcher.curriculum_state(done - 1)
        checkpoint.save(
            self.cfg.output_dir,
            done,
            self.policy,
            self.opt,
            self.sched,
            state,
            self.model_dir,
            self.rank,
            counters,
            pending,
        )
        if self.rank == 0:
            path = checkpoint.checkpoint_dir(self.cfg.output_dir, done)
            self.hooks.call("after_checkpoint", done, path)

    def _record(
        self,
        done: int,
        t0: float,
        acc: dict[str, Any],
        books: StepBooks,
        eob: EndOfBatch,
        grad_norm: float,
        lr: float,
        timings: dict[str, float],
    ) -> dict[str, Any]:
        """The step's row of training_metrics.jsonl."""
        elapsed = time.perf_counter() - t0
        idle = sum(timings.get(k, 0.0) for k in IDLE_KEYS)
        timings["time/idle_fraction"] = idle / elapsed if elapsed > 0 else 0.0
        sums = books.sums
        summary = summarize_metrics(
            {k: v for k, v in sums.items() if k.endswith(("_sum", "_max")) or k == "tokens"}
        )
        return {
            "samples_seen": self.samples_seen,
            "policy_version": done,
            "loss": sums.get("loss_total", 0.0) / max(books.denom, 1),
            "grad_norm": grad_norm,
            "lr": lr,
            "minibatches": acc["passes"],
            "reduce_passes": acc["reduce_passes"],
            "tokens_per_s": books.all_tokens / elapsed,
            "time/step": elapsed,
            "time/elapsed": time.perf_counter() - self.t_start,
            "clip_fraction": summary.get("clip_low_frac", 0.0) + summary.get("clip_high_frac", 0.0),
            "kl": summary.get("kl_mean", 0.0),
            "entropy": summary.get("entropy_mean", 0.0),
            **{k: v for k, v in summary.items() if k != "tokens"},
            **eob.stats,
            **self.policy.attention.stats(),
            **timings,
            **acc.get("update_figures", {}),  # several updates: their mean loss, clip counts
        }

    def _report(self, step: int, record: dict[str, Any], eob: EndOfBatch) -> None:
        """Write the row and the timeline, tell the hooks and the bar; warn or stop on the
        step's scoring failures and lost groups."""
        spans = self.spans.take()
        if self.writer is not None:
            self.writer.log(step + 1, record)
        if self.timeline is not None:
            self.timeline.write(step + 1, spans + eob.spans)
        if self.rank == 0:
            self.hooks.call("after_step", step + 1, record, eob.samples)
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{eob.stats.get('reward/mean', 0.0):.3f}")
            self.bar.update(1)
        if self.rank == 0:
            self._check_scoring(step, eob.stats)
            lost = eob.stats.get("samples/missing")  # then what the failed attempts said
            causes = self.batcher.group_failure_causes(step) if lost else []
            line = check_lost_groups(step, eob.stats, self.cfg.batcher.max_missing_fraction, causes)
            if line:
                print(f"warning: {line}", file=sys.stderr, flush=True)

    def _check_scoring(self, step: int, stats: dict[str, float]) -> None:
        """Samples that failed to score (reward error or timeout) get reward 0: a warning
        line below `verifier.max_error_fraction` of the step, a stop (exit 2) at it."""
        failed, scored = (
            stats.get("verifier/step_failures", 0),
            stats.get("verifier/step_scored", 0),
        )
        if not failed:
            return
        reasons = "; ".join(self.batcher.score_failure_reasons(step)) or "?"
        line = f"verifier: {failed:.0f}/{scored:.0f} samples failed to score in step {step + 1}: {reasons}"
        if failed >= self.cfg.verifier.max_error_fraction * scored:
            raise UserError(
                f"{line} (verifier.max_error_fraction={self.cfg.verifier.max_error_fraction:g});"
                " stopping instead of training on zero rewards"
            )
        print(f"warning: {line}", file=sys.stderr, flush=True)
