"""The trainer's log-probs of a completion, for tests that compare an engine's against them:
transformers in fp32 through the trainer's own packed path (core/packing, core/logprobs)."""

from pathlib import Path

import torch


def trainer_logprobs(model_dir: Path, prompt_ids: list[int], completion_ids: list[int]):
    """Per-token log-probs [T] of `completion_ids` after `prompt_ids` (fp32, packed)."""
    from transformers import AutoModelForCausalLM

    from async_grpo.core.logprobs import batch_logprobs
    from async_grpo.core.packing import PackInput, pack

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    n = len(completion_ids)
    batch = pack([PackInput(list(prompt_ids), list(completion_ids), 0.0, [0.0] * n)])
    with torch.no_grad():
        return batch_logprobs(model, batch)[0][batch.loss_mask]
