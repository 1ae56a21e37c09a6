"""The algorithm core: pure tensor functions, no Ray and no torch.distributed.

In: scored samples (token ids, rewards/advantages, sampler log-probs) and model outputs.
Out: packed rows and minibatch plans (`packing`), chunked per-token log-probs and entropy
(`logprobs`), group-relative advantages (`advantages`), and the configured GRPO loss with
exact global normalisation (`loss`). The trainer calls these; they never call it back.
"""
