"""Rewards: score a sample's completion against its ground truth.

In: `RewardInput` (prompt, completion, answer, metadata) and the reward names of a
`VerifierConfig` (built-ins `countdown`, `math`, `exact`, `last_number`; `@reward` functions; entry points
of the `async_grpo.rewards` group; `"module.path:function"`).
Out: one `RewardOutput` (reward, named components, reason) per sample, computed in
killable subprocesses (`sandbox`) by `VerifierWorker`s, usually as Ray actors (`pool`).
"""

from async_grpo.rewards.registry import (
    CombinedReward,
    RewardInput,
    RewardOutput,
    combine,
    get_reward,
    known_rewards,
    reward,
)

__all__ = [
    "CombinedReward",
    "RewardInput",
    "RewardOutput",
    "combine",
    "get_reward",
    "known_rewards",
    "reward",
]
