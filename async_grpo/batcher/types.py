"""Wire types from the batcher to the trainer ranks."""

from __future__ import annotations

from dataclasses import dataclass, field

from async_grpo.core.packing import PackInput


@dataclass
class ScoredSample:
    """One completion with its reward and group advantage.

    Invariants: len(logprobs) == len(completion_ids); `version` is the policy version that
    generated it (the oldest, for a multi-turn episode); `ref_logprobs` is None unless the
    KL penalty is on. A multi-turn episode's `completion_ids` are every token after the
    prompt, the environment's included: `completion_mask` is True at the model's tokens
    (their `logprobs` are the sampler's) and False at the environment's (log-prob 0.0, no
    loss); `episode` holds its per-episode figures (turns, tool calls, errors) for metrics.
    `token_versions` (None: all `version`) is the version that sampled each completion token
    when a weight update came while it was generated. A harness rollout whose prefix broke
    trains as several samples; the ones after its first have `continues` set (the books
    count rollouts, and the group advantage is the rollout's).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    reward: float
    components: dict[str, float]
    advantage: float
    version: int
    truncated: bool
    ref_logprobs: list[float] | None = None
    completion_mask: list[bool] | None = None
    episode: dict[str, float] | None = None
    prompt_index: int = -1  # which prompt of the data (the curriculum's records)
    reason: str = ""  # the verifier's reason for the reward
    token_versions: list[int] | None = None  # per completion token, after an in-flight update
    continues: bool = False  # a later segment of the same rollout (after a prefix break)

    def to_log(self, step: int) -> dict:
        """This sample for `samples.jsonl` (token ids; trainer rank 0 decodes them)."""
        return {
            "step": step + 1,
            "prompt_index": self.prompt_index,
            "prompt_ids": self.prompt_ids,
            "completion_ids": self.completion_ids,
            "reward": self.reward,
            "reason": self.reason,
            "advantage": self.advantage,
            "components": self.components,
            "version": self.version,
            "truncated": self.truncated,
        }

    def to_pack_input(self) -> PackInput:
        return PackInput(
            self.prompt_ids,
            self.completion_ids,
            self.advantage,
            self.logprobs,
            self.ref_logprobs,
            None,
            self.truncated,
            self.completion_mask,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def loss_tokens(self) -> int:
        """Completion tokens that carry loss: the model's own."""
        if self.completion_mask is None:
            return len(self.completion_ids)
        return sum(self.completion_mask)


def rollouts(samples: list[ScoredSample]) -> int:
    """How many rollouts `samples` hold (a harness's later segments are not counted)."""
    return sum(not s.continues for s in samples)


@dataclass
class Minibatch:
    """What one rank runs in one forward/backward. `samples` may be empty (a padding pass
    that keeps the ranks' collectives in step); their tokens total <= max_tokens_per_gpu.
    `last`: the step's final round (the same on every rank), after which gradients are
    reduced; a round streamed before the batch was complete is never marked. With several
    updates per batch, `part` is the update (mini-batch) it belongs to and `last` marks
    each part's final round."""

    step: int
    samples: list[PackInput]
    num_tokens: int
    last: bool = False
    part: int = 0


@dataclass
class EndOfBatch:
    """Closes step `step` for a rank: the global counts for exact normalisation (summed over
    every rank and minibatch of the step) and the batch's statistics. The global counts
    include the `skipped_*` samples, which were counted but not sent (their gradient is 0)."""

    step: int
    global_tokens: int  # completion tokens that carry loss
    global_samples: int
    num_minibatches: int  # per rank, identical on every rank
    stats: dict[str, float] = field(default_factory=dict)
    skipped_tokens: int = 0
    skipped_samples: int = 0
    samples: list[dict] = field(default_factory=list)  # a few, every `sample_every` steps
    spans: list[dict] = field(default_factory=list)  # the pools' timeline spans (rank 0's)
    # several updates per batch: each part's (loss tokens, samples), skipped ones apart
    part_counts: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class PushNow:
    """Sent to every rank between the same two minibatches when a generation worker serves
    an older policy version than `version` (a replacement, a late joiner): each rank pushes
    the weights it holds now (a collective), mid-step, before reading on."""

    version: int
