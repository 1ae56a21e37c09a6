"""Per-token policy versions: read from vLLM's spans, counted in the staleness metrics."""

from dataclasses import dataclass

from async_grpo.batcher.stats import batch_stats
from async_grpo.batcher.types import ScoredSample
from async_grpo.inference.generation import sampled_version, token_versions


@dataclass
class Span:  # vLLM's WeightVersionSpan: output tokens [start, end) sampled by `version`
    version: str
    start: int
    end: int


def test_spans_become_one_version_per_token():
    spans = [Span("3", 0, 4), Span("4", 4, 7)]
    assert token_versions(spans, 7, 3) == [3, 3, 3, 3, 4, 4, 4]
    assert sampled_version(spans, 3) == 3


def test_one_version_or_no_spans_give_none():
    assert token_versions([Span("5", 0, 6)], 6, 5) is None
    assert token_versions(None, 4, 2) is None
    assert token_versions([], 0, 2) is None


def test_unlabelled_tokens_keep_the_version_the_request_started_on():
    # vLLM labels "" before any update; spans past the end are clipped
    assert token_versions([Span("", 0, 2), Span("1", 2, 9)], 5, 0) == [0, 0, 1, 1, 1]


def test_token_staleness_counts_each_token_at_its_own_version():
    step = 5
    whole = ScoredSample([1], [7, 8], [0.0, 0.0], 1.0, {}, 0.0, 4, False)
    mixed = ScoredSample([1], [7, 8, 9, 10], [0.0] * 4, 0.0, {}, 0.0, 3, False)
    mixed.token_versions = [3, 3, 5, 5]
    stats = batch_stats(step, [[whole, mixed]], 0.0)
    assert stats["staleness/mean"] == (1 + 2) / 2  # by the oldest token of each sample
    assert stats["staleness/max"] == 2
    assert stats["staleness/token_mean"] == (1 + 1 + 2 + 2 + 0 + 0) / 6
    assert stats["samples/mixed_versions"] == 0.5
