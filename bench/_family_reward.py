"""The reward of bench/model_families.py: 1 for a completion of even length in characters,
else 0. A tiny random model scores about half its samples 1, so every step has a gradient."""

from async_grpo.rewards import RewardInput


def parity(sample: RewardInput) -> float:
    return float(len(sample.completion) % 2 == 0)
