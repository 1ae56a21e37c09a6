"""A real `Trainer` (FSDP2 policy, loss, optimizer step) fed by a scripted batcher.

The batcher is the one part replaced: the tests here are about what `Trainer.step` does
with the minibatches it is given, on whatever process group and device it runs on."""

from __future__ import annotations

import random
from dataclasses import replace

import torch

from async_grpo.batcher.types import EndOfBatch, Minibatch
from async_grpo.config import LossConfig, RunConfig, TrainerConfig
from async_grpo.core.loss import loss_counts
from async_grpo.core.packing import PackInput, pack, plan_minibatches
from async_grpo.trainer.loop import Trainer
from async_grpo.trainer.model import build_policy

VOCAB = 49152
BUDGET = 40
LOSS = LossConfig(kl_coef=0.05, entropy_coef=0.01, mask_truncated=True, temperature=0.9)


def run_config(tmp_dir: str, **trainer: object) -> RunConfig:
    """fp32 compute (an exact comparison), SGD-like updates are made by the caller's
    optimizer; no push and no checkpoint within the first steps."""
    t = TrainerConfig(
        compute_dtype="float32",
        grad_clip=1e9,
        max_steps=100,
        push_every=1000,
        loss=LOSS,
        **trainer,
    )
    return replace(RunConfig(), output_dir=tmp_dir, trainer=t)


def samples(seed: int = 5, n: int = 9) -> list[PackInput]:
    """Uneven samples with every per-token input the loss reads; every 4th is truncated."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        n_p, n_c = rng.randint(2, 8), rng.randint(1, 10)
        behaviour = [-rng.uniform(8.0, 12.0) for _ in range(n_c)]
        out.append(
            PackInput(
                prompt_ids=[rng.randrange(VOCAB) for _ in range(n_p)],
                completion_ids=[rng.randrange(VOCAB) for _ in range(n_c)],
                advantage=rng.uniform(-1.5, 1.5),
                behaviour_logprobs=behaviour,
                ref_logprobs=[b + rng.uniform(-0.5, 0.5) for b in behaviour],
                truncated=i % 4 == 3,
            )
        )
    return out


def part_of(all_samples: list[PackInput], parts: int) -> list[list[PackInput]]:
    """The samples in `parts` contiguous parts, as the batcher splits a step's groups."""
    n = len(all_samples)
    return [all_samples[m * n // parts : (m + 1) * n // parts] for m in range(parts)]


class ScriptedBatcher:
    """What the batcher would send one rank for step 0: its planned minibatches, then the
    step's EndOfBatch with the global counts."""

    def __init__(
        self,
        all_samples: list[PackInput],
        rank: int,
        world: int,
        mark_last: bool = True,
        parts: int = 1,
    ) -> None:
        """`parts` > 1: the samples in that many contiguous parts (`part_of`), each packed
        into rounds of its own, as the batcher sends several updates per batch."""
        tokens, count = loss_counts(pack(all_samples), LOSS.mask_truncated)
        self.items: list[object] = []
        part_counts = []
        for m, part in enumerate(part_of(all_samples, parts)):
            lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in part]
            plan = plan_minibatches(lengths, BUDGET, world)
            depth = len(plan[rank])
            self.items += [
                Minibatch(
                    0,
                    [part[i] for i in mb],
                    sum(lengths[i] for i in mb),
                    last=mark_last and k == depth - 1,
                    part=m,
                )
                for k, mb in enumerate(plan[rank])
            ]
            part_counts.append(loss_counts(pack(part), LOSS.mask_truncated))
        eob = EndOfBatch(0, tokens, count, len(self.items), {"reward/mean": 0.5})
        eob.part_counts = part_counts if parts > 1 else []
        self.items.append(eob)
        self.versions: list[int] = []

    def next(self) -> object:
        return self.items.pop(0)

    def set_version(self, version: int) -> None:
        self.versions.append(version)


def trainer(model_dir: str, cfg: RunConfig, device: torch.device, batcher: object) -> Trainer:
    """A Trainer on the current process group with plain SGD at lr 1: after one step the
    parameters moved by exactly minus the normalised gradient."""
    world = torch.distributed.get_world_size()
    policy = build_policy(model_dir, cfg.trainer, device, world)
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    return Trainer(cfg, policy, opt, sched, batcher, model_dir, device)
