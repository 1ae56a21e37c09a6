"""A trainer rank's set-up: the process group, Ray, the batcher link, the sharded policy
and optimizer, the resumed state, the pusher, and rank 0's hooks and metrics; then its run
(`train`, what `async-grpo train` calls on each torchrun rank)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from async_grpo.config import RunConfig
from async_grpo.hooks import Hooks
from async_grpo.placement import bind_process, parse_cpus
from async_grpo.trainer.loop import Trainer
from async_grpo.trainer.push import WeightPusher


def process_group_backend(device_type: str) -> str:
    """The default group's backend for each device type it carries tensors of: host
    tensors (counts, barriers) over gloo and, on CUDA, the FSDP collectives over NCCL.
    A collective on a tensor of any other device type fails, so none may be issued."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "cpu:gloo"


def select_trainer_attention(cfg: RunConfig) -> tuple[Any, str]:
    """The trainer's attention backend for its device (core/attention), or a ConfigError."""
    from async_grpo.config import ConfigError
    from async_grpo.core.attention import select_attention

    t, b = cfg.trainer, cfg.batcher
    try:
        return select_attention(t.attention, t.device, b.share_prompts, True, b.max_tokens_per_gpu)
    except ValueError as e:
        raise ConfigError(f"trainer.attention: {e}") from None


def build_trainer(
    cfg: RunConfig, address: str | None, resume: str | None, verbose: bool = False
) -> Trainer:
    """Everything a rank needs, in order: process group, Ray, the batcher, the sharded
    policy, the optimizer, the resumed state; rank 0 also gets the pusher and the metrics.
    Quiet unless `verbose`: the batcher's output goes to OUTPUT_DIR/logs/batcher.log."""
    from async_grpo.logs import log_dir, quiet_libraries, ray_errors_to_file
    from async_grpo.models import resolve_model
    from async_grpo.ray_utils import connect
    from async_grpo.run import wait_for_pools
    from async_grpo.trainer import checkpoint
    from async_grpo.trainer.batcher_link import group_timeout, setup_batcher
    from async_grpo.trainer.model import build_optimizer, build_policy

    t = cfg.trainer
    timeout = group_timeout(cfg)
    if t.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group(process_group_backend("cuda"), device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group(process_group_backend("cpu"), timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if t.cpus is not None:
        bind_process(parse_cpus(t.cpus, "trainer.cpus"), "trainer.cpus")
    torch.set_num_threads(t.threads)
    torch.manual_seed(cfg.batcher.seed)
    if not verbose:
        quiet_libraries()
    connect(address, log_to_driver=verbose)
    if not verbose:  # Ray's "(raylet) A worker died ..." lines (the batcher's, evaluator's)
        ray_errors_to_file(log_dir(cfg.output_dir) / "ray.log")
    if rank == 0 and not cfg.environment.multi_turn and cfg.verifier.rewards:  # rules score
        from async_grpo.rewards.pool import check_verifiers

        check_verifiers(cfg.verifier)
    if rank == 0 and cfg.verifier.judge.model and not cfg.environment.multi_turn:
        from async_grpo.rewards.judge import check_judges

        check_judges(cfg.verifier.judge)
    model_dir = str(resolve_model(cfg.model))
    resume_from = checkpoint.find_resume(cfg.output_dir, resume) if resume else None
    attention, reason = select_trainer_attention(cfg)
    # the batcher's actor starts while the policy loads and the engines start: it asks the
    # pools for nothing until `start` (its process start was ~6 s before the first step)
    batcher = setup_batcher(
        cfg, model_dir, rank, world, None if verbose else log_dir(cfg.output_dir)
    )
    policy = build_policy(model_dir, t, device, world, attention, seed=cfg.batcher.seed)
    opt, sched = build_optimizer(policy, t)
    wait_for_pools()
    trainer = Trainer(cfg, policy, opt, sched, batcher, model_dir, device)
    trainer.attention_reason = reason
    if resume_from is not None:
        trainer.resume(resume_from)
    trainer.pusher = WeightPusher(
        policy,
        rank,
        t.device,
        t.weight_transport,
        in_flight=cfg.generation.weight_update == "in_flight",
    )
    if rank == 0:
        trainer.log_dir = None if verbose else log_dir(cfg.output_dir)
        trainer.hooks = Hooks(rank0_hooks(cfg, trainer))
        from async_grpo.metrics import MetricsWriter

        trainer.writer = MetricsWriter(
            cfg.output_dir, trackers=cfg.trackers, after_step=trainer.start
        )
        from async_grpo.timeline import TimelineWriter

        trainer.timeline = TimelineWriter(cfg.output_dir, trainer.start)
    return trainer


def rank0_hooks(cfg: RunConfig, trainer: Trainer) -> list[Any]:
    """The hooks of rank 0, in order: the checkpoint announcement, the sample log, the
    held-out evaluation, then the user's (`cfg.hooks`)."""
    from async_grpo.hooks import load_hooks
    from async_grpo.trainer.run_hooks import AnnounceCheckpoint, SampleLog

    hooks: list[Any] = [AnnounceCheckpoint(trainer.pusher)]
    if cfg.sample_every:
        hooks.append(SampleLog(trainer.start))
    if cfg.eval.data:
        from async_grpo.evaluation.hook import EvalHook

        hooks.append(EvalHook(cfg, trainer.model_dir, trainer.start))
    return hooks + load_hooks(cfg.hooks)


def train(
    cfg: RunConfig, address: str | None, resume: str | None = None, verbose: bool = False
) -> None:
    build_trainer(cfg, address, resume, verbose).run()
