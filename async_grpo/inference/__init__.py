"""The serving half: vLLM generation workers, log-prob workers and their registries.

In: prompt token ids (generation) or (prompt, completion) pairs (log-probs), and weight
updates from the trainer. Out: completions with sampling log-probs and policy versions.
Callers reach workers through `PoolClient`, which leases from a `LeastLoadedRegistry`.
"""
