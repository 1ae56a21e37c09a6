"""The trainer process (one per torchrun rank): pull minibatches, step, push, checkpoint.

How it departs from the GRPO paper: the loss of each minibatch is the plain sum of its
per-token terms, and the gradient is divided by the step's global count (loss tokens or
samples, all-reduced over ranks) just before the optimizer step. That is exactly the
whole-batch gradient, and it lets minibatches stream in before the batch is complete.
Samples may be up to `max_off_policy_steps` policy versions old (truncated importance
sampling corrects for it); with 0 it is on-policy GRPO.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from async_grpo.batcher.types import EndOfBatch
from async_grpo.config import RunConfig
from async_grpo.core.loss import build_loss, loss_counts, summarize_metrics
from async_grpo.core.packing import pack

GET_TIMEOUT_S = 3600.0


def _setup_batcher(cfg: RunConfig, model_dir: str, rank: int, world: int) -> Any:
    """Rank 0 creates the named batcher actor; the other ranks look it up."""
    import ray

    from async_grpo.batcher.batcher import ExperienceBatcher
    from async_grpo.data.tokenize import prepare_prompts
    from async_grpo.ray_utils import NAMESPACE

    name = f"batcher:{os.path.abspath(cfg.output_dir)}"
    if rank == 0:
        prompts = prepare_prompts(cfg.data, model_dir, cfg.generation.max_model_len)
        actor = ray.remote(ExperienceBatcher).options(
            name=name, namespace=NAMESPACE, num_cpus=0, max_concurrency=1000
        )
        batcher = actor.remote(cfg, prompts, world)
    dist.barrier()
    if rank != 0:
        batcher = ray.get_actor(name, namespace=NAMESPACE)
    return batcher


class Trainer:
    """One torchrun rank. Rank 0 also owns the batcher, the weight pusher and the metrics."""

    def __init__(self, cfg: RunConfig, address: str | None, resume: str | None) -> None:
        from async_grpo.models import resolve_model
        from async_grpo.ray_utils import connect
        from async_grpo.trainer import checkpoint
        from async_grpo.trainer.model import build_optimizer, build_policy

        self.cfg, t = cfg, cfg.trainer
        if t.device == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
            # host tensors (counts, barriers) over gloo, device tensors (FSDP) over NCCL
            dist.init_process_group("cpu:gloo,cuda:nccl", device_id=self.device)
        else:
            self.device = torch.device("cpu")
            dist.init_process_group("gloo")
        self.backend = "nccl" if t.device == "cuda" else "gloo"  # the weight-sync group's
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.set_num_threads(t.threads)
        torch.manual_seed(cfg.batcher.seed)
        connect(address)
        self.model_dir = str(resolve_model(cfg.model))
        self.batcher = _setup_batcher(cfg, self.model_dir, self.rank, self.world)
        attention, self.attention_reason = select_trainer_attention(cfg)
        self.policy = build_policy(self.model_dir, t, self.device, self.world, attention)
        self.opt, self.sched = build_optimizer(self.policy, t)
        self.loss_fn = build_loss(t.loss, cfg.generation.max_new_tokens)
        self.start = 0
        if resume:
            path = checkpoint.find_resume(cfg.output_dir, resume)
            self.start = checkpoint.load(path, self.policy, self.opt, self.sched)
        self.pusher = self.writer = self.bar = None
        if self.rank == 0:
            from tqdm import tqdm

            from async_grpo.metrics import MetricsWriter
            from async_grpo.trainer.push import WeightPusher

            self.pusher = WeightPusher(["generation"], self.backend)
            self.writer = MetricsWriter(cfg.output_dir, tensorboard=cfg.tensorboard)
            self.bar = tqdm(total=t.max_steps, initial=self.start, desc="steps", dynamic_ncols=True)

    def run(self) -> None:
        import ray

        from async_grpo.trainer.model import full_state_dict

        self.t_start = time.perf_counter()
        state = full_state_dict(self.policy)
        if self.rank == 0:  # the workers serve exactly the weights step `start` trains
            self.pusher.push(state, self.start)
            self._write_params()
            ray.get(self.batcher.start.remote(self.start))
            ray.get(self.batcher.set_version.remote(self.start))
        del state
        for step in range(self.start, self.cfg.trainer.max_steps):
            self.step(step)
        if self.rank == 0:
            ray.get(self.batcher.stop.remote())
            self.writer.close()
            self.bar.close()
        dist.barrier()
        dist.destroy_process_group()

    def _write_params(self) -> None:
        """training_params.json: the config, and what `auto` resolved to in each process."""
        p = self.policy
        resolved = {
            "trainer_compute_dtype": p.precision.describe(),
            "trainer_attention": f"{p.attention.name} ({self.attention_reason})",
            "trainer_activation_checkpointing": p.checkpointing,
            "generation_dtype": self.pusher.worker_dtypes,
            "weight_push_dtype": self.pusher.wire_dtype,
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
        import ray

        acc: dict[str, Any] = {
            "sums": defaultdict(float),
            "passes": 0,
            "tokens": 0,
            "counts": [0, 0],
            "time/wait": 0.0,
            "time/forward_backward": 0.0,
        }
        mask_truncated = self.cfg.trainer.loss.mask_truncated
        use_entropy = bool(self.cfg.trainer.loss.entropy_coef)
        while True:
            tw = time.perf_counter()
            item = ray.get(
                self.batcher.get.remote(self.rank, GET_TIMEOUT_S), timeout=GET_TIMEOUT_S + 60
            )
            acc["time/wait"] += time.perf_counter() - tw
            if isinstance(item, EndOfBatch):
                return item, acc
            tf = time.perf_counter()
            batch = pack(item.samples, share_prompts=self.cfg.batcher.share_prompts)
            batch = self.policy.attention.prepare(batch).to(self.device)
            logp, ent = self.policy(batch, True)
            loss, m = self.loss_fn(logp, batch, 1, 1, ent if use_entropy else None, 1)
            loss.backward()
            m["entropy_sum"] = ent.detach()[batch.loss_mask].sum()
            m["loss_total"] = loss.detach()
            for k, v in m.items():
                acc["sums"][k] += float(v)
            tokens, samples = loss_counts(batch, mask_truncated)
            acc["counts"][0] += tokens
            acc["counts"][1] += samples
            acc["passes"] += 1
            acc["tokens"] += item.num_tokens
            acc["time/forward_backward"] += time.perf_counter() - tf

    def step(self, step: int) -> None:
        import ray

        from async_grpo.trainer import checkpoint
        from async_grpo.trainer.model import full_state_dict, scale_grads

        t, t0 = self.cfg.trainer, time.perf_counter()
        eob, acc = self._accumulate(step)
        if acc["passes"] != eob.num_minibatches:
            raise RuntimeError(
                f"rank {self.rank}: ran {acc['passes']} minibatches, batcher"
                f" sent {eob.num_minibatches}"
            )
        to = time.perf_counter()
        keys = sorted(acc["sums"])
        flat = torch.tensor(
            [*acc["counts"], acc["tokens"], *(acc["sums"][k] for k in keys)], dtype=torch.float64
        )
        dist.all_reduce(flat)
        n_tok, n_seq, all_tokens = int(flat[0]), int(flat[1]), float(flat[2])
        sums = dict(zip(keys, flat[3:].tolist(), strict=True))
        n_tok, n_seq = n_tok + eob.skipped_tokens, n_seq + eob.skipped_samples
        if (n_tok, n_seq) != (eob.global_tokens, eob.global_samples):
            raise RuntimeError(
                f"step {step}: trainer counted {n_tok} tokens / {n_seq} samples"
                f" (skipped ones included), batcher {eob.global_tokens} / {eob.global_samples}"
            )
        denom = n_tok if t.loss.aggregation == "token_mean" else n_seq
        if denom:
            scale_grads(self.policy, self.world / denom)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), t.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = self.sched.get_last_lr()[0]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        timings = {k: acc[k] for k in ("time/wait", "time/forward_backward")}
        timings["time/optimizer"] = time.perf_counter() - to
        done = step + 1
        save = bool(t.save_every and done % t.save_every == 0) or done == t.max_steps
        push = done % t.push_every == 0 and done < t.max_steps
        state = full_state_dict(self.policy) if (save or push) else {}
        if push and self.rank == 0:
            timings |= self.pusher.push(state, done)
            ray.get(self.batcher.set_version.remote(done))
        if save:
            ts = time.perf_counter()
            checkpoint.save(
                self.cfg.output_dir,
                done,
                self.policy,
                self.opt,
                self.sched,
                state,
                self.model_dir,
                self.rank,
            )
            timings["time/checkpoint"] = time.perf_counter() - ts
        if self.rank == 0:
            elapsed = time.perf_counter() - t0
            summary = summarize_metrics(
                {k: v for k, v in sums.items() if k.endswith("_sum") or k == "tokens"}
            )
            record = {
                "samples_seen": done
                * self.cfg.batcher.questions_per_step
                * self.cfg.batcher.samples_per_question,
                "policy_version": done,
                "loss": sums["loss_total"] / max(denom, 1),
                "grad_norm": float(grad_norm),
                "lr": lr,
                "minibatches": acc["passes"],
                "tokens_per_s": all_tokens / elapsed,
                "time/step": elapsed,
                "time/elapsed": time.perf_counter() - self.t_start,
                "clip_fraction": summary.get("clip_low_frac", 0.0)
                + summary.get("clip_high_frac", 0.0),
                "kl": summary.get("kl_mean", 0.0),
                "entropy": summary.get("entropy_mean", 0.0),
                **{k: v for k, v in summary.items() if k != "tokens"},
                **eob.stats,
                **self.policy.attention.stats(),
                **timings,
            }
            self.writer.log(done, record)
            self.bar.set_postfix(reward=f"{eob.stats.get('reward/mean', 0.0):.3f}")
            self.bar.update(1)


def select_trainer_attention(cfg: RunConfig) -> tuple[Any, str]:
    """The trainer's attention backend for its device (core/attention), or a ConfigError."""
    from async_grpo.config import ConfigError
    from async_grpo.core.attention import select_attention

    t, b = cfg.trainer, cfg.batcher
    try:
        return select_attention(t.attention, t.device, b.share_prompts, True, b.max_tokens_per_gpu)
    except ValueError as e:
        raise ConfigError(f"trainer.attention: {e}") from None


def train(cfg: RunConfig, address: str | None, resume: str | None = None) -> None:
    Trainer(cfg, address, resume).run()
