"""The numbers of an evaluation: pass@k (unbiased) and the `eval/*` summary. Pure."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from math import comb
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k completions drawn without replacement from the
    n sampled (c of which pass) passes: 1 - C(n - c, k) / C(n, k). With k == n it is
    1 if any passed; with k == 1 it is c / n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass
class EvalSample:
    """One evaluated completion. `question` indexes the eval prompts; `version` is the
    policy version that sampled it (vLLM's label)."""

    question: int
    prompt: str
    completion: str
    answer: Any
    reward: float
    passed: bool
    reason: str
    length: int
    truncated: bool
    version: int
    components: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EvalResult:
    """One evaluation of `version`: its `eval/*` metrics, its samples, and `error` when it
    could not finish (then the metrics cover the questions that were answered)."""

    version: int
    metrics: dict[str, float]
    samples: list[EvalSample]
    seconds: float
    error: str | None = None


def summarize(samples: list[EvalSample], n: int, pass_k: list[int]) -> dict[str, float]:
    """`eval/*` metrics over the questions whose n samples all arrived: mean reward,
    pass@k for each k (averaged over questions), mean length, truncated fraction, each
    reward component's mean, and the counts."""
    by_question: dict[int, list[EvalSample]] = defaultdict(list)
    for s in samples:
        by_question[s.question].append(s)
    complete = [group for group in by_question.values() if len(group) == n]
    done = [s for group in complete for s in group]
    out = {"eval/questions": float(len(complete)), "eval/samples": float(len(done))}
    if not done:
        return out
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    out["eval/reward/mean"] = mean([s.reward for s in done])
    for k in pass_k:
        out[f"eval/pass_at_{k}"] = mean(
            [pass_at_k(n, sum(s.passed for s in g), k) for g in complete]
        )
    out["eval/output_length/mean"] = mean([float(s.length) for s in done])
    out["eval/truncated_fraction"] = mean([float(s.truncated) for s in done])
    out["eval/score_errors"] = float(sum(s.reason.startswith(("error", "timeout")) for s in done))
    for key in sorted({k for s in done for k in s.components}):
        out[f"eval/reward/{key}"] = mean([s.components.get(key, 0.0) for s in done])
    return out
