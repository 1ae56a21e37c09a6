"""The trainer: one torchrun process per rank (FSDP2), fed by the ExperienceBatcher.

In: minibatches of packed samples and their batch's global counts. Out: optimizer steps,
weights pushed to the generation workers, checkpoints and `training_metrics.jsonl`.
"""
