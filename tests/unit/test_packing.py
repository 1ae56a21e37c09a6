"""Packing layout, minibatch planning, and attention isolation of packed rows."""

from __future__ import annotations

import os
import random

import pytest
import torch
from _tiny import tiny_llama

from async_grpo.core.logprobs import batch_logprobs, logprobs_from_logits, packed_forward
from async_grpo.core.packing import PackInput, pack, plan_minibatches


def _sample(prompt, completion, adv=0.0, truncated=False, ref=True, old=False) -> PackInput:
    n = len(completion)
    return PackInput(
        prompt_ids=list(prompt),
        completion_ids=list(completion),
        advantage=adv,
        behaviour_logprobs=[-0.1 * (k + 1) for k in range(n)],
        ref_logprobs=[-0.2 * (k + 1) for k in range(n)] if ref else None,
        old_logprobs=[-0.3 * (k + 1) for k in range(n)] if old else None,
        truncated=truncated,
    )


def test_pack_layout_by_hand():
    b = pack([_sample([5, 6], [7, 8, 9], adv=1.5), _sample([1], [2], adv=-2.0, truncated=True)])
    # row:           5     6   7   8     9     1   2
    # predicts:      6     7   8   9     -     2   -    (position t predicts token t + 1)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert b.labels.tolist() == [[-100, 7, 8, 9, -100, 2, -100]]
    assert b.loss_mask.tolist() == [False, True, True, True, False, True, False]
    assert b.sample_index.tolist() == [0, 0, 0, 0, 0, 1, 1]
    assert b.advantages.tolist() == [0.0, 1.5, 1.5, 1.5, 0.0, -2.0, 0.0]
    want = [0.0, -0.1, -0.2, -0.3, 0.0, -0.1, 0.0]
    assert b.behaviour_logprobs.tolist() == pytest.approx(want)
    assert b.ref_logprobs.tolist() == pytest.approx([2 * w for w in want])
    assert b.old_logprobs is None
    assert b.truncated.tolist() == [False] * 5 + [True] * 2
    assert b.seq_lens == [5, 2]
    assert b.cu_seqlens.tolist() == [0, 5, 7] and b.cu_seqlens.dtype == torch.int32
    assert (b.num_samples, b.num_tokens) == (2, 4)


def test_pack_rejects_bad_samples():
    with pytest.raises(ValueError, match="sample 1: behaviour_logprobs has 1 entries, expected 2"):
        bad = _sample([1], [2, 3])
        bad.behaviour_logprobs = [-1.0]
        pack([_sample([1], [2]), bad])
    with pytest.raises(ValueError, match="ref_logprobs: given for 1 of 2"):
        pack([_sample([1], [2]), _sample([1], [2], ref=False)])
    with pytest.raises(ValueError, match="sample 0: empty prompt"):
        pack([_sample([], [2])])


def test_empty_minibatch_is_a_one_token_placeholder():
    b = pack([], pad_token_id=3)
    assert b.input_ids.tolist() == [[3]] and b.labels.tolist() == [[-100]]
    assert (b.num_samples, b.num_tokens, b.loss_mask.any().item()) == (0, 0, False)


def test_plan_minibatches_invariants():
    rng = random.Random(0)
    for trial in range(50):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(0, 30))]
        ranks = rng.randint(1, 4)
        plan = plan_minibatches(lengths, max_tokens=50, num_ranks=ranks)
        assert len(plan) == ranks
        assert len({len(p) for p in plan}) == 1, f"trial {trial}: uneven minibatch counts"
        flat = sorted(i for p in plan for mb in p for i in mb)
        assert flat == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in mb) <= 50 for p in plan for mb in p)


def test_plan_minibatches_by_hand():
    # FFD bins of 10: [7, 3] (7 first, then 3 fits), [6, 4], [5] -> dealt fullest first:
    # rank 0 gets [0, 4] (10 tokens), rank 1 [1, 3] (10), rank 0 [2] (5); rank 1 padded.
    plan = plan_minibatches([7, 6, 5, 4, 3], max_tokens=10, num_ranks=2)
    assert plan == [[[0, 4], [2]], [[1, 3], []]]
    assert plan_minibatches([], max_tokens=10, num_ranks=2) == [[], []]  # no empty round
    with pytest.raises(ValueError, match="sample 2 has 11 tokens, above max_tokens=10"):
        plan_minibatches([1, 2, 11], max_tokens=10, num_ranks=1)


def _samples(vocab: int, lens: list[tuple[int, int]], seed: int = 0) -> list[PackInput]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n_p, n_c in lens:
        ids = torch.randint(0, vocab, (n_p + n_c,), generator=g).tolist()
        out.append(_sample(ids[:n_p], ids[n_p:]))
    return out


def _one_at_a_time(model, samples: list[PackInput]) -> torch.Tensor:
    """Completion-token log-probs, each sample in its own forward (the ground truth)."""
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.completion_ids])  # [1, n]
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)  # [n, V]
        n_p = len(s.prompt_ids)
        targets = torch.tensor(s.completion_ids)  # [n_c]
        out.append(logp[n_p - 1 : -1].gather(-1, targets[:, None])[:, 0])
    return torch.cat(out)  # [loss tokens]


def _check_packed_matches(model, samples, tol: float) -> None:
    batch = pack(samples)
    with torch.no_grad():
        want = _one_at_a_time(model, samples)
        logits = packed_forward(model, batch)  # [T, V]
        got, _ = logprobs_from_logits(logits, batch.labels[0].clamp(min=0), chunk_size=16)
        assert (got[batch.loss_mask] - want).abs().max().item() <= tol
        got_hidden, _ = batch_logprobs(model, batch, chunk_size=16)  # the trainer's path
        assert (got_hidden[batch.loss_mask] - want).abs().max().item() <= tol


LENS = [(5, 9), (3, 4), (12, 20), (1, 1), (7, 15)]


def test_packed_logprobs_match_one_at_a_time_tiny_llama():
    model = tiny_llama()
    _check_packed_matches(model, _samples(model.config.vocab_size, LENS), tol=1e-5)


def test_packed_rows_leak_when_a_kv_cache_is_built():
    """The pitfall packed_forward avoids: with use_cache=True transformers skips the
    position_ids-derived mask and later rows attend to earlier ones."""
    model = tiny_llama()
    batch = pack(_samples(model.config.vocab_size, LENS))
    with torch.no_grad():
        isolated = packed_forward(model, batch)  # [T, V]
        leaky = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=True)
    first = batch.seq_lens[0]
    assert torch.allclose(leaky.logits[0, :first], isolated[:first], atol=1e-5)
    assert (leaky.logits[0, first:] - isolated[first:]).abs().max().item() > 1e-2


@pytest.mark.slow
def test_packed_logprobs_match_one_at_a_time_smollm2():
    from transformers import AutoModelForCausalLM

    from async_grpo.models import prepare_smollm2

    folder = os.environ.get("ASYNC_GRPO_MODEL_DIR") or prepare_smollm2()  # converted once, cached

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    samples = _samples(model.config.vocab_size, [(6, 10), (4, 7), (9, 12)])
    # 30 fp32 layers round differently when only the row length changes (measured: logits
    # of the same tokens move ~4e-5, log-probs up to ~1.2e-5); a leak moves them by ~4.7.
    _check_packed_matches(model, samples, tol=1e-4)
