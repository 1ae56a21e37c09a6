"""Held-out evaluation: prompts in, pass@k and reward metrics out.

In: held-out prompts (the training JSONL format), a policy version the generation pool
serves (or a model folder, for `async-grpo eval`), the eval settings (`EvalConfig`).
Out: an `EvalResult`: `eval/*` metrics and one `EvalSample` per completion. During a run
the `EvalHook` (trainer rank 0) starts one evaluation per due pushed version in an
`Evaluator` actor; its requests lease generation in the background, behind training.
"""

from async_grpo.evaluation.scoring import EvalResult, EvalSample, pass_at_k, summarize

__all__ = ["EvalResult", "EvalSample", "pass_at_k", "summarize"]
