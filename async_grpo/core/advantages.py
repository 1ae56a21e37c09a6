"""GRPO group-relative advantages.

In: the rewards of the G samples drawn for one prompt (a group), or of many groups [N, G].
Out: one advantage per sample, `(r - mean) / (std + eps)` (or `r - mean` for Dr.GRPO,
`std_norm=False`), and whether the group had zero variance.

`std` is the population standard deviation (correction 0), so a group of one is simply a
zero-variance group; TRL and verl use the unbiased one, larger by sqrt(G / (G - 1)).
A group whose rewards are all equal (std <= eps) gets all-zero advantages and is reported:
it carries no learning signal, and the caller counts it (and may drop it) instead of
dividing by ~0.
"""

from __future__ import annotations

from torch import Tensor


def batched_group_advantages(
    rewards: Tensor, std_norm: bool = True, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """Advantages [N, G] (float32) and a zero-variance flag per group [N] for rewards [N, G]."""
    if rewards.dim() != 2 or rewards.shape[1] < 1:
        raise ValueError(f"rewards: expected shape [N, G] with G >= 1, got {list(rewards.shape)}")
    r = rewards.float()  # [N, G]
    mean = r.mean(-1, keepdim=True)  # [N, 1]
    std = r.std(-1, correction=0, keepdim=True)  # [N, 1]
    zero_variance = std[:, 0] <= eps  # [N]
    centred = r - mean  # [N, G]
    adv = centred / (std + eps) if std_norm else centred  # [N, G]
    adv = adv.masked_fill(zero_variance[:, None], 0.0)  # [N, G]
    return adv, zero_variance


def group_advantages(
    rewards: Tensor, std_norm: bool = True, eps: float = 1e-6
) -> tuple[Tensor, bool]:
    """Advantages [G] and the zero-variance flag for the rewards [G] of one group."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected shape [G], got {list(rewards.shape)}")
    adv, zero_variance = batched_group_advantages(rewards[None], std_norm, eps)
    return adv[0], bool(zero_variance[0])
