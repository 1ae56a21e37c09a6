"""`Trainer.step` on the real path (FSDP2 policy, `scale_grads`, placeholder passes,
clipping, optimizer step) against the single-process whole-batch gradient, and the
process group it needs: a group with a backend only for the trainer's device types."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import one_rank_group, run_two_ranks
from _tiny import tiny_llama
from _trainer import LOSS, ScriptedBatcher, part_of, run_config, samples, trainer
from transformers import AutoModelForCausalLM

from async_grpo.core.logprobs import batch_logprobs
from async_grpo.core.loss import build_loss, loss_counts, loss_weight_mask
from async_grpo.core.packing import pack, plan_minibatches
from async_grpo.trainer.model import full_state_dict
from async_grpo.trainer.setup import process_group_backend

COLLECTIVES = [
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(seed=4).save_pretrained(path)
    return str(path)


def _reference(model_dir: str) -> tuple[dict[str, torch.Tensor], float]:
    """The whole batch in one forward/backward, normalised by its own counts, no FSDP:
    the gradients, and the mean entropy over the tokens that carry loss."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    batch = pack(samples())
    tokens, count = loss_counts(batch, LOSS.mask_truncated)
    logp, ent = batch_logprobs(model, batch, LOSS.temperature, 1024, True)
    loss, _ = build_loss(LOSS, 64)(logp, batch, tokens, count, ent, 1)
    loss.backward()
    entropy = ent.detach()[loss_weight_mask(batch, LOSS.mask_truncated)].mean().item()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, entropy


def _step_delta(
    model_dir: str, out: str, rank: int, world: int, defer: bool = True, mark_last: bool = True
) -> None:
    """Run step 0 on this rank; rank 0 saves before - after (= the gradient, SGD at lr 1)."""
    cfg = run_config(out, defer_grad_sync=defer)
    batcher = ScriptedBatcher(samples(), rank, world, mark_last)
    tr = trainer(model_dir, cfg, torch.device("cpu"), batcher)
    before = {k: v.clone() for k, v in full_state_dict(tr.policy).items()}  # 1 rank: views
    record = tr.step(0)
    after = full_state_dict(tr.policy)
    if rank == 0:
        delta = {k: before[k] - after[k] for k in before}
        torch.save({"delta": delta, "record": record}, Path(out) / "step.pt")


def _rank(rank: int, model_dir: str, out: str, defer: bool, mark_last: bool) -> None:
    _step_delta(model_dir, out, rank, 2, defer, mark_last)


def _assert_delta_is_gradient(out: Path, model_dir: str) -> dict:
    saved = torch.load(out / "step.pt")
    ref, entropy = _reference(model_dir)
    # truncated samples carry no loss (mask_truncated): nor do they count in the entropy
    assert saved["record"]["entropy"] == pytest.approx(entropy, rel=1e-5)
    compared = 0
    for name, g in ref.items():
        d = saved["delta"][name]
        scale = g.abs().max().item()
        assert scale > 0, name
        assert (d - g).abs().max().item() <= 1e-4 * scale + 1e-7, name
        compared += 1
    assert compared == len(ref) >= 10
    return saved["record"]


def test_plan_has_a_placeholder_pass():
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples()]
    plan = plan_minibatches(lengths, 40, 2)
    assert len(plan[0]) == len(plan[1]) >= 2
    assert [] in plan[0] + plan[1], "the 2-rank test should cover an empty minibatch"


@pytest.mark.parametrize(
    ("defer", "mark_last", "reduce_passes"),
    [(False, True, 0), (True, True, 0), (True, False, 1)],
    ids=["sync-every-minibatch", "sync-on-last", "sync-by-extra-pass"],
)
def test_two_rank_step_equals_whole_batch_gradient(
    model_dir, tmp_path, defer, mark_last, reduce_passes
):
    """Gradients reduced after every minibatch, only in the last one's backward, or (the
    last round was streamed, so not marked) by a one-token pass: the same exact gradient."""
    run_two_ranks(_rank, model_dir, str(tmp_path), defer, mark_last)
    record = _assert_delta_is_gradient(tmp_path, model_dir)
    assert record["reduce_passes"] == reduce_passes
    _, count = loss_counts(pack(samples()), LOSS.mask_truncated)
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples()]
    assert record["samples_seen"] == count < len(samples())  # truncated ones left out
    assert record["minibatches"] == len(plan_minibatches(lengths, 40, 2)[0])


def test_step_issues_collectives_only_on_the_groups_devices(model_dir, tmp_path, monkeypatch):
    """Every collective of a step (the trainer's counts, FSDP's gathers and reductions)
    carries a tensor of a device type the default group has a backend for. Here the
    group is `cpu:gloo` only, as a CUDA trainer's is `cpu:gloo,cuda:nccl`."""
    seen: set[str] = set()
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def spy(*args, _real=real, **kwargs):
            for a in [*args, *kwargs.values()]:
                for t in a if isinstance(a, list) else [a]:
                    if isinstance(t, torch.Tensor):
                        seen.add(t.device.type)
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, spy)
    backend = process_group_backend("cpu")
    assert backend == "cpu:gloo"
    with one_rank_group(backend):
        _step_delta(model_dir, str(tmp_path), 0, 1)
    allowed = {part.split(":")[0] for part in backend.split(",")}
    assert seen and seen <= allowed
    _assert_delta_is_gradient(tmp_path, model_dir)


def test_cuda_group_carries_host_tensors():
    """The counts all-reduce is a host tensor: the CUDA trainer's group must map cpu too."""
    devices = dict(part.split(":") for part in process_group_backend("cuda").split(","))
    assert devices == {"cpu": "gloo", "cuda": "nccl"}


@pytest.mark.parametrize("tied", [False, True])
def test_sharded_build_loads_exactly_the_saved_model(tmp_path, tied):
    """Built on meta, then each rank's rows read from the file: the policy's log-probs
    equal those of the model transformers loads whole (tied LM head included)."""
    from async_grpo.config import TrainerConfig
    from async_grpo.trainer.model import build_policy

    tiny_llama(seed=6, tie_word_embeddings=tied).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    model.config.use_cache = False
    batch = pack(samples())
    with torch.no_grad():
        want, _ = batch_logprobs(model, batch, 1.0, 1024, False)
    with one_rank_group("cpu:gloo"):
        policy = build_policy(
            str(tmp_path), TrainerConfig(compute_dtype="float32"), torch.device("cpu"), 1
        )
        assert (policy.hf.lm_head.weight is policy.hf.model.embed_tokens.weight) == tied
        with torch.no_grad():
            got, _ = policy(batch, False)
    assert torch.equal(got, want)


class _CatchUpPusher:
    """Rank 0's view of the pool: `behind` workers; records each push and the weights it
    would send (the policy's full state at that moment)."""

    def __init__(self, policy, behind):
        self.policy, self._behind, self.pushed = policy, behind, []

    def behind(self, version):
        return list(self._behind)

    def push(self, version):
        state = {k: v.clone() for k, v in full_state_dict(self.policy).items()}
        self.pushed.append((version, state))
        return {}


@pytest.mark.parametrize("behind", [["replacement-1"], []])
def test_a_push_now_mid_step_sends_the_weights_held_and_leaves_the_step_exact(
    model_dir, tmp_path, behind
):
    """A PushNow between two minibatches: the ranks push the weights of version `step`
    (before this step's update) if a worker is still behind, then train on; the step's
    update is still exactly the whole-batch gradient."""
    from async_grpo.batcher.types import PushNow

    with one_rank_group(process_group_backend("cpu")):
        cfg = run_config(str(tmp_path))
        batcher = ScriptedBatcher(samples(), 0, 1)
        assert len(batcher.items) >= 3  # two minibatches at least, then the EndOfBatch
        batcher.items.insert(1, PushNow(0))
        tr = trainer(model_dir, cfg, torch.device("cpu"), batcher)
        tr.pusher = _CatchUpPusher(tr.policy, behind)
        before = {k: v.clone() for k, v in full_state_dict(tr.policy).items()}
        record = tr.step(0)
        after = full_state_dict(tr.policy)
        delta = {k: before[k] - after[k] for k in before}
        torch.save({"delta": delta, "record": record}, Path(tmp_path) / "step.pt")
    _assert_delta_is_gradient(tmp_path, model_dir)
    assert record["weight_catch_up_pushes"] == len(tr.pusher.pushed) == len(behind)
    if behind:
        version, sent = tr.pusher.pushed[0]
        assert version == 0 and batcher.versions == [0]
        assert all(torch.equal(sent[k], before[k]) for k in before)  # not yet updated
    else:
        assert batcher.versions == []


def _updates_reference(model_dir: str, parts: int, epochs: int) -> dict[str, torch.Tensor]:
    """Several SGD updates (lr 1) in one process, no FSDP: each part's loss normalised by
    its own counts, the ratio against the policy before the first update."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    batches = [pack(part) for part in part_of(samples(), parts)]
    loss_fn = build_loss(LOSS, 64)
    for batch in batches:
        with torch.no_grad():
            old, _ = batch_logprobs(model, batch, LOSS.temperature, 1024, True)
        batch.old_logprobs = old.masked_fill(~batch.loss_mask, 0.0)
    for _ in range(epochs):
        for batch in batches:
            tokens, count = loss_counts(batch, LOSS.mask_truncated)
            logp, ent = batch_logprobs(model, batch, LOSS.temperature, 1024, True)
            loss, _ = loss_fn(logp, batch, tokens, count, ent, 1)
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p -= p.grad
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _parts_rank(rank: int, model_dir: str, out: str, parts: int, epochs: int) -> None:
    cfg = run_config(out, mini_batches=parts, epochs=epochs)
    batcher = ScriptedBatcher(samples(), rank, 2, parts=parts)
    tr = trainer(model_dir, cfg, torch.device("cpu"), batcher)
    record = tr.step(0)
    after = full_state_dict(tr.policy)
    if rank == 0:
        torch.save({"after": after, "record": record}, Path(out) / "step.pt")


@pytest.mark.parametrize(("parts", "epochs"), [(2, 1), (2, 2)])
def test_several_updates_per_batch_are_each_parts_own_gradient(model_dir, tmp_path, parts, epochs):
    """`trainer.mini_batches` parts, `trainer.epochs` passes: on 2 ranks each update is the
    SGD step of its part's own loss (normalised by the part's counts) at the weights the
    previous update left, its ratio taken against the policy before the first update:
    the weights after the step equal one process doing those updates in turn."""
    run_two_ranks(_parts_rank, model_dir, str(tmp_path), parts, epochs)
    saved = torch.load(tmp_path / "step.pt")
    want = _updates_reference(model_dir, parts, epochs)
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    start = dict(initial.named_parameters())
    moved = 0
    for name, w in want.items():
        got = saved["after"][name]
        step = (w - start[name]).abs().max().item()
        assert (got - w).abs().max().item() <= 1e-4 * step + 1e-6, name
        moved += step > 0
    assert moved >= 10
    record = saved["record"]
    assert record["updates"] == parts * epochs
    # the first update's ratio is exactly 1: nothing to clip; lr 1 moves the next ones off
    assert record["clip_fraction/first_update"] == 0.0
    assert record["clip_fraction/last_update"] > 0.0
