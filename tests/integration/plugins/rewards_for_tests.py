"""A reward with variance even for a tiny random model, so the loop's gradients are real.

Loaded by the verifier through the "module:function" spec with this folder on PYTHONPATH.
"""

import ctypes
import time

from async_grpo.rewards import RewardInput, RewardOutput


def vowel_share(sample: RewardInput) -> RewardOutput:
    text = sample.completion
    score = sum(c in "aeiouAEIOU" for c in text) / len(text) if text else 0.0
    return RewardOutput(score, {"vowels": score})


def broken(sample: RewardInput) -> RewardOutput:
    """A reward that fails on every sample (a wrong reward for the data, say)."""
    raise KeyError(f"no 'target' in metadata {sorted(sample.metadata)}")


def hangs(sample: RewardInput) -> RewardOutput:
    """Never returns (the verifier's timeout must end it)."""
    time.sleep(3600)
    return RewardOutput(1.0)


def segfaults(sample: RewardInput) -> RewardOutput:
    """Kills its process with SIGSEGV (reads address 0)."""
    ctypes.string_at(0)
    return RewardOutput(1.0)


def hogs_memory(sample: RewardInput) -> RewardOutput:
    """Asks for 10 GB (the scoring process's memory limit must refuse it)."""
    block = bytearray(10 * 1024**3)
    return RewardOutput(float(len(block) > 0))
