"""The ExperienceBatcher and its channel to the trainer ranks.

In: prompts, and the generation / verifier / logprob pools. Out: per rank, token-budgeted
`Minibatch`es and one `EndOfBatch` per step with the step's global counts and statistics.
"""
