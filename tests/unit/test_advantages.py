"""Group advantages against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from async_grpo.core.advantages import batched_group_advantages, group_advantages


def test_std_normalised():
    # rewards [1, 0, 0, 1]: mean 0.5, population std 0.5 -> (r - 0.5) / (0.5 + 1e-6)
    adv, zero = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), std_norm=True)
    a = 0.5 / (0.5 + 1e-6)
    assert adv.tolist() == pytest.approx([a, -a, -a, a], abs=1e-6) and zero is False
    # rewards [2, 0, 1]: mean 1, std sqrt(((1)^2 + (-1)^2 + 0) / 3) = sqrt(2/3) = 0.8164966
    adv, _ = group_advantages(torch.tensor([2.0, 0.0, 1.0]), std_norm=True)
    b = 1 / (math.sqrt(2 / 3) + 1e-6)  # 1.2247434
    assert adv.tolist() == pytest.approx([b, -b, 0.0], abs=1e-6)


def test_dr_grpo_mean_only():
    # rewards [1, 0, 0, 1] - 0.5, no division
    adv, zero = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), std_norm=False)
    assert adv.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5], abs=1e-6) and zero is False


@pytest.mark.parametrize("std_norm", [True, False])
def test_zero_variance_groups_get_zero_and_are_reported(std_norm):
    adv, zero = group_advantages(torch.tensor([0.7, 0.7, 0.7]), std_norm=std_norm)
    assert adv.tolist() == [0.0, 0.0, 0.0] and zero is True
    adv, zero = group_advantages(torch.tensor([3.0]), std_norm=std_norm)  # a group of one
    assert adv.tolist() == [0.0] and zero is True


def test_batched_matches_per_group():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.3, 0.3, 0.3, 0.3], [5.0, 1.0, 2.0, 0.0]])
    adv, zero = batched_group_advantages(rewards, std_norm=True)
    assert zero.tolist() == [False, True, False]
    for row in range(3):
        want, want_zero = group_advantages(rewards[row], std_norm=True)
        assert torch.equal(adv[row], want) and bool(zero[row]) == want_zero
    with pytest.raises(ValueError, match=r"expected shape \[N, G\]"):
        batched_group_advantages(torch.zeros(4))
