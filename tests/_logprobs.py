"""The trainer's log-probs of a completion, for tests that compare an engine's against them:
a transformers model in fp32 through the trainer's own packed path (core/packing,
core/logprobs), and the prompt they ask the real SmolLM2."""

import torch

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]  # greedy: Paris


def trainer_logprobs(model: torch.nn.Module, prompt_ids: list[int], completion_ids: list[int]):
    """Per-token log-probs [T] of `completion_ids` after `prompt_ids` (packed) under `model`."""
    from async_grpo.core.logprobs import batch_logprobs
    from async_grpo.core.packing import PackInput, pack

    n = len(completion_ids)
    batch = pack([PackInput(list(prompt_ids), list(completion_ids), 0.0, [0.0] * n)])
    with torch.no_grad():
        return batch_logprobs(model, batch)[0][batch.loss_mask]
