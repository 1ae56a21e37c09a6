"""Exact global normalisation: 2 gloo ranks, uneven samples, several minibatches each,
gradient accumulation then a SUM all-reduce (loss world_size=1) or DDP's averaging
all-reduce (loss world_size=2), give the single-process whole-batch gradient, for every
objective under every aggregation and for the sequence-level corrections."""

from __future__ import annotations

import datetime
import random
import socket
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from async_grpo.config import CorrectionConfig, LossConfig
from async_grpo.core.logprobs import logprobs_from_hidden
from async_grpo.core.loss import build_loss, loss_counts
from async_grpo.core.packing import PackedBatch, PackInput, pack, plan_minibatches

AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_sum_constant"]
CFG = LossConfig(
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=3.0,
    kl_coef=0.05,
    kl_estimator="k3",
    entropy_coef=0.01,
    constant_normalizer=6.0,
    correction=CorrectionConfig(cap=2.0),
    mask_truncated=True,
    temperature=0.9,
)
VOCAB, MAX_TOKENS = 32, 12
SEQUENCE_CORRECTIONS = {
    "sequence-mask": CorrectionConfig(
        level="sequence", mode="mask", cap=3.0, floor=0.2, negative_threshold=0.1
    ),
    "geometric-truncate": CorrectionConfig(level="geometric", cap=1.2),
}
VARIANTS = {  # name -> the loss config's overrides
    **{
        f"{objective}/{agg}": {"objective": objective, "aggregation": agg}
        for objective in ("ppo", "gspo", "cispo", "gmpo", "sapo")
        for agg in AGGREGATIONS
    },
    **{name: {"correction": c} for name, c in SEQUENCE_CORRECTIONS.items()},
}


class TinyLM(nn.Module):
    """Token + position embeddings, tanh, bias-free head; returns chunked log-probs."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 8)
        self.pos = nn.Embedding(MAX_TOKENS, 8)
        self.head = nn.Linear(8, VOCAB, bias=False)

    def forward(self, batch: PackedBatch) -> tuple[Tensor, Tensor]:
        hidden = torch.tanh(self.tok(batch.input_ids[0]) + self.pos(batch.position_ids[0]))
        targets = batch.labels[0].clamp(min=0)  # [T]
        return logprobs_from_hidden(
            hidden, self.head.weight, targets, CFG.temperature, chunk_size=4, with_entropy=True
        )


def _samples() -> list[PackInput]:
    rng = random.Random(3)  # seed chosen so that rank 0 ends on an empty minibatch
    out = []
    for i in range(11):
        n_p, n_c = rng.randint(1, 4), rng.randint(1, 6)
        behaviour = [-rng.uniform(2.0, 4.0) for _ in range(n_c)]
        out.append(
            PackInput(
                prompt_ids=[rng.randrange(VOCAB) for _ in range(n_p)],
                completion_ids=[rng.randrange(VOCAB) for _ in range(n_c)],
                advantage=rng.uniform(-1.5, 1.5),
                behaviour_logprobs=behaviour,
                ref_logprobs=[b + rng.uniform(-0.5, 0.5) for b in behaviour],
                old_logprobs=[b + rng.uniform(-0.8, 0.8) for b in behaviour],
                truncated=i % 4 == 3,
            )
        )
    return out


def _plan(samples: list[PackInput]) -> list[list[list[int]]]:
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    return plan_minibatches(lengths, MAX_TOKENS, num_ranks=2)


def _global_counts(batches: list[PackedBatch]) -> tuple[int, int]:
    """Loss tokens and samples of the whole step: this rank's minibatches, summed over ranks."""
    counts = torch.tensor([0, 0])
    for b in batches:
        counts += torch.tensor(loss_counts(b, CFG.mask_truncated))
    if dist.is_initialized():
        dist.all_reduce(counts)
    tokens, samples = counts.tolist()
    return tokens, samples


def _backward(
    model: nn.Module,
    batches: list[PackedBatch],
    variant: str,
    counts: tuple[int, int],
    world: int,
) -> None:
    """Accumulate the gradients of `batches` normalised by the step's global `counts`."""
    loss_fn = build_loss(replace(CFG, **VARIANTS[variant]))
    for b in batches:
        logp, entropy = model(b)
        loss, _ = loss_fn(logp, b, *counts, entropy=entropy, world_size=world)
        loss.backward()


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    samples = _samples()
    batches = [pack([samples[i] for i in mb]) for mb in _plan(samples)[rank]]
    counts = _global_counts(batches)
    grads = {}
    for aggregation in VARIANTS:
        # SUM all-reduce of the accumulated gradients: the loss is not scaled
        torch.manual_seed(0)
        model = TinyLM()
        _backward(model, batches, aggregation, counts, world=1)
        for p in model.parameters():
            dist.all_reduce(p.grad)
        grads["sum", aggregation] = [p.grad for p in model.parameters()]
        # DDP averages over ranks: the loss is scaled by world_size; no_sync accumulates and
        # the last minibatch's backward all-reduces the accumulated sum
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(TinyLM())
        with ddp.no_sync():
            _backward(ddp, batches[:-1], aggregation, counts, world=2)
        _backward(ddp, batches[-1:], aggregation, counts, world=2)
        grads["ddp", aggregation] = [p.grad for p in ddp.module.parameters()]
    torch.save(grads, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_plan_is_uneven_with_an_empty_minibatch():
    plan = _plan(_samples())
    assert [sum(len(mb) for mb in p) for p in plan] == [5, 6]  # uneven sample counts
    # rank 0 pads with a placeholder, last: under DDP its backward does the all-reduce
    assert len(plan[0]) == len(plan[1]) == 4 and plan[0][-1] == []


def test_two_rank_gradient_equals_whole_batch_gradient(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    samples = _samples()
    whole = pack(samples)
    for aggregation in VARIANTS:
        torch.manual_seed(0)
        model = TinyLM()
        _backward(model, [whole], aggregation, _global_counts([whole]), world=1)
        want = [p.grad for p in model.parameters()]
        assert max(g.abs().max().item() for g in want) > 1e-3  # a gradient worth comparing
        for rank in (0, 1):
            got = torch.load(tmp_path / f"rank{rank}.pt")
            for mode in ("sum", "ddp"):
                for g, w in zip(got[mode, aggregation], want, strict=True):
                    diff = (g - w).abs().max().item()
                    assert diff <= 1e-5, f"{mode} {aggregation} rank {rank}: {diff}"


@pytest.mark.parametrize("aggregation", VARIANTS)
def test_split_changes_nothing_in_one_process(aggregation):
    """The same identity without processes: any split into minibatches, same gradient."""
    samples = _samples()
    grads = []
    for split in ([list(range(11))], [[0, 5, 9], [1], [], [2, 3, 4, 6, 7, 8, 10]]):
        torch.manual_seed(0)
        model = TinyLM()
        batches = [pack([samples[i] for i in mb]) for mb in split]
        _backward(model, batches, aggregation, _global_counts(batches), world=1)
        grads.append([p.grad for p in model.parameters()])
    for g, w in zip(*grads, strict=True):
        assert (g - w).abs().max().item() <= 1e-6
