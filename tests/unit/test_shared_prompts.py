"""Shared-prompt packing: layout, mask, and log-probs / gradients equal to unshared rows."""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_llama

from async_grpo.core.logprobs import batch_logprobs
from async_grpo.core.packing import (
    PackInput,
    pack,
    packed_length,
    packed_tokens,
    prompt_groups,
    shared_prefix_mask,
)


def _sample(prompt, completion, adv=0.0) -> PackInput:
    n = len(completion)
    return PackInput(list(prompt), list(completion), adv, [-0.1 * (k + 1) for k in range(n)])


def test_shared_layout_by_hand():
    samples = [_sample([5, 6, 7], [8, 9], 1.0), _sample([5, 6, 7], [4], -1.0), _sample([1], [2])]
    b = pack(samples, share_prompts=True)
    # row:      5  6 | 7  8  9 | 7  4 | 1  2
    # predicts: -  - | 8  9  - | 4  - | 2  -     (prefix 5 6 shared by samples 0 and 1)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 7, 4, 1, 2]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3, 0, 1]]
    assert b.labels.tolist() == [[-100, -100, 8, 9, -100, 4, -100, 2, -100]]
    assert b.sample_index.tolist() == [0, 0, 0, 0, 0, 1, 1, 2, 2]
    assert b.shared_prefix.tolist() == [True, True] + [False] * 7
    assert b.advantages.tolist() == [0, 0, 1, 1, 0, -1, 0, 0, 0]
    assert b.seq_lens == [7, 2] and (b.num_samples, b.num_tokens) == (3, 4)
    assert packed_length(3, [2, 1], True) == 7 and packed_length(3, [2, 1], False) == 9
    for share in (True, False):  # what the batcher budgets is what pack builds
        assert packed_tokens(samples, share) == pack(samples, share_prompts=share).input_ids.numel()
    allowed = shared_prefix_mask(b)[0, 0]
    assert allowed[5].tolist() == [True, True, False, False, False, True, False, False, False]
    assert allowed[4].tolist() == [True] * 5 + [False] * 4
    assert allowed[8].tolist() == [False] * 7 + [True, True]


def test_unshared_rows_need_no_mask():
    samples = [_sample([5, 6], [8]), _sample([5, 6], [9])]
    assert pack(samples).shared_prefix is None  # position_ids isolate them
    assert pack(samples, share_prompts=True).needs_explicit_mask
    assert prompt_groups(samples + [_sample([1], [2]), _sample([5, 6], [3])], True) == [
        [0, 1],
        [2],
        [3],
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_probs_and_gradients_match_unshared(dtype):
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, 49152, (n,), generator=g).tolist()  # noqa: E731
    prompts = [rand(9), rand(4)]
    samples = [_sample(prompts[0], rand(n), a) for n, a in [(5, 1.0), (3, -0.5), (7, 0.2)]]
    samples += [_sample(prompts[1], rand(n), a) for n, a in [(2, 0.7), (6, -1.0)]]
    results = []
    for share in (False, True):
        model = tiny_llama(seed=1).to(dtype)
        batch = pack(samples, share_prompts=share)
        logp, _ = batch_logprobs(model, batch)
        (logp * batch.advantages).sum().backward()
        picked = logp[batch.loss_mask]  # in sample order either way
        grads = torch.cat([p.grad.flatten().float() for p in model.parameters()])
        results.append((picked.detach(), grads, batch.input_ids.numel()))
    (lp_a, g_a, n_a), (lp_b, g_b, n_b) = results
    assert n_b == n_a - 2 * 8 - 1 * 3  # each sibling's copy of the prompt but its last token
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(lp_a, lp_b, atol=tol), (lp_a - lp_b).abs().max()
    rel = (g_a - g_b).norm() / g_a.norm()
    assert rel < (1e-5 if dtype == torch.float32 else 3e-2), rel


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_sum_constant"])
def test_zero_advantage_samples_add_nothing_to_the_gradient(aggregation):
    """Why the batcher may skip equal-reward groups (no KL, no entropy): run or not, the
    summed loss and its gradient are the same; only the global count must include them."""
    from async_grpo.config import LossConfig
    from async_grpo.core.loss import build_loss

    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(0, 49152, (n,), generator=g).tolist()  # noqa: E731
    learn = [_sample(rand(6), rand(n), a) for n, a in [(5, 1.2), (4, -1.2)]]
    flat = [_sample(rand(5), rand(n), 0.0) for n in (7, 3)]  # an all-equal-reward group
    loss_fn = build_loss(LossConfig(kl_coef=0.0, entropy_coef=0.0, aggregation=aggregation), 8)
    grads, losses = [], []
    for samples in (learn + flat, learn):
        model = tiny_llama(seed=2)
        batch = pack(samples)
        logp, _ = batch_logprobs(model, batch)
        loss, _ = loss_fn(logp, batch, 1, 1, None, 1)
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert losses[0] == pytest.approx(losses[1], abs=1e-7)
    assert torch.allclose(grads[0], grads[1], atol=1e-7, rtol=1e-5)
    assert grads[1].abs().max() > 1e-6  # the learning samples do move the model
