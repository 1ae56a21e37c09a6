"""Pack scored samples into one padding-free row, and plan minibatches across ranks.

In: `PackInput`s (token ids, advantage, per-completion-token log-probs).
Out: a `PackedBatch` whose per-token tensors are aligned on *prediction positions*:
entry `t` describes the prediction made at position `t`, i.e. of token `t + 1` of the
same sample. So `labels[0, t] = input_ids[0, t + 1]` when that token is a completion token
of the same sample, else -100 (prompt targets, each sample's last position, padding);
`loss_mask = labels[0] != -100`. A multi-turn sample's environment tokens
(`PackInput.completion_mask` False) are context like the prompt: label -100, no loss. The model's logits at `t` are scored against `labels[0, t]`
directly, with no further shift.

Attention isolation: positions restart at 0 in each sample (`position_ids`), and the
dense path passes an explicit mask (`shared_prefix_mask`, windowed per layer type): some
families (transformers 5.19, sdpa/eager) derive a block-diagonal mask from restarting
positions when no KV cache is built, but not all of them (Falcon, GPT-OSS do not).
`core/logprobs.packed_forward` always passes `use_cache=False`. Other kernels (flash-attn
varlen, flex_attention with a BlockMask) are attention backends (core/attention/) passed to
`packed_forward`/`packed_hidden` (core/logprobs.py, above the backends); `pad_to` pads a
row to a fixed length for kernels compiled per shape.

Shared prompts (`pack(..., share_prompts=True)`): consecutive samples with the same prompt
(a GRPO group) carry that prompt once. The row holds the prompt minus its last token, then
one segment per sample: the prompt's last token (at its original position, so it still
predicts the completion's first token) followed by the completion. Each segment attends to
the shared prefix and to itself, never to a sibling, so every log-prob equals the unshared
one; gradients of the prefix sum over the siblings exactly as the separate copies would.
A group of 8 samples with a 56-token prompt and 25-token completions packs 264 tokens
instead of 648. Such rows need the explicit mask of `shared_prefix_mask` (no varlen kernel
expresses it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100


@dataclass
class PackInput:
    """One scored sample. The three log-prob lists have one entry per completion token."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    behaviour_logprobs: list[float]  # what the sampler (vLLM) reported
    ref_logprobs: list[float] | None = None  # reference policy, for the KL penalty
    old_logprobs: list[float] | None = None  # trainer-side old policy, if recomputed
    truncated: bool = False  # cut at the generation length limit
    # per completion token: True where the model generated it (a target of the loss), False
    # where an environment wrote it (context only); None: every completion token is a target
    completion_mask: list[bool] | None = None


@dataclass
class PackedBatch:
    """Samples concatenated into one row of T tokens. Per-token tensors follow the
    prediction-position convention of the module docstring and are 0 where `loss_mask` is
    False. `num_tokens` counts loss tokens, `num_samples` real samples; the placeholder for an
    empty minibatch (see `pack`) has one pad token, `num_samples == 0` and no loss token."""

    input_ids: Tensor  # [1, T] long
    position_ids: Tensor  # [1, T] long, restarting at 0 per sample
    labels: Tensor  # [1, T] long, next token of the same sample or -100
    sample_index: Tensor  # [T] long, which sample each position belongs to
    advantages: Tensor  # [T] float32
    behaviour_logprobs: Tensor  # [T] float32
    ref_logprobs: Tensor | None  # [T] float32
    old_logprobs: Tensor | None  # [T] float32
    loss_mask: Tensor  # [T] bool
    truncated: Tensor  # [T] bool, the sample's truncated flag at each of its positions
    seq_lens: list[int]  # tokens of each group (each sample, unshared)
    cu_seqlens: Tensor  # [num_groups + 1] int32, cumulative seq_lens from 0
    num_samples: int
    num_tokens: int
    shared_prefix: Tensor | None = None  # [T] bool, a group's shared prompt; None: unshared

    @property
    def needs_explicit_mask(self) -> bool:
        """True when position_ids alone cannot isolate the samples (shared prompts)."""
        return self.shared_prefix is not None

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch with every tensor moved to `device`."""
        moved = {
            k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()
        }
        return PackedBatch(**moved)


def packed_length(prompt_len: int, completion_lens: list[int], share_prompts: bool) -> int:
    """Tokens that samples with one prompt take in a row, shared or not."""
    if share_prompts:
        return prompt_len - 1 + sum(n + 1 for n in completion_lens)
    return sum(prompt_len + n for n in completion_lens)


def prompt_groups(samples: list[PackInput], share_prompts: bool) -> list[list[int]]:
    """Indices of samples that share one copy of their prompt: runs of consecutive samples
    with equal `prompt_ids` when sharing, else one sample per group."""
    groups: list[list[int]] = []
    for i, s in enumerate(samples):
        if share_prompts and groups and samples[groups[-1][0]].prompt_ids == s.prompt_ids:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def group_lengths(samples: list[PackInput], groups: list[list[int]]) -> list[int]:
    """Row tokens of each group of `prompt_groups` (a group of one is an unshared sample)."""
    return [
        packed_length(
            len(samples[g[0]].prompt_ids), [len(samples[i].completion_ids) for i in g], True
        )
        for g in groups
    ]


def packed_tokens(samples: list[PackInput], share_prompts: bool) -> int:
    """Row tokens `pack(samples, share_prompts=...)` will produce."""
    return sum(group_lengths(samples, prompt_groups(samples, share_prompts)))


def pack(
    samples: list[PackInput], pad_token_id: int = 0, share_prompts: bool = False
) -> PackedBatch:
    """Concatenate `samples` into a `PackedBatch` (prompts shared within runs of equal prompts
    when `share_prompts`; see the module docstring).

    `ref_logprobs` / `old_logprobs` must be given for all samples or for none. An empty list
    gives a placeholder batch of one `pad_token_id` with no loss token: the trainer runs its
    forward/backward anyway (the loss is an exact 0 but still depends on every parameter), so
    every rank joins the same FSDP collectives.
    """
    if not samples:
        return _placeholder(pad_token_id)
    for name in ("ref_logprobs", "old_logprobs"):
        given = [getattr(s, name) is not None for s in samples]
        if any(given) and not all(given):
            raise ValueError(
                f"{name}: given for {sum(given)} of {len(samples)} samples; need all or none"
            )
    has_ref, has_old = samples[0].ref_logprobs is not None, samples[0].old_logprobs is not None
    ids, pos, labels, index, shared = [], [], [], [], []
    adv, behaviour, ref, old = [], [], [], []
    groups = prompt_groups(samples, share_prompts)
    for group in groups:
        prompt = samples[group[0]].prompt_ids
        n_p = len(prompt)
        # the shared prefix: every prompt token but the last, predicting prompt tokens only
        ids += prompt[:-1]
        pos += range(n_p - 1)
        index += [group[0]] * (n_p - 1)
        shared += [True] * (n_p - 1)
        labels += [IGNORE_INDEX] * (n_p - 1)
        zeros = [0.0] * (n_p - 1)
        adv += zeros
        behaviour += zeros
        ref += zeros if has_ref else []
        old += zeros if has_old else []
        for i in group:
            s = samples[i]
            _check(i, s)
            n_c = len(s.completion_ids)
            # the prompt's last token predicts completion token 0; position t predicts t + 1
            ids += prompt[-1:] + s.completion_ids
            pos += range(n_p - 1, n_p + n_c)
            index += [i] * (n_c + 1)
            shared += [False] * (n_c + 1)
            targets = s.completion_mask or [True] * n_c
            labels += [
                t if m else IGNORE_INDEX for t, m in zip(s.completion_ids, targets, strict=True)
            ]
            labels += [IGNORE_INDEX]
            adv += [s.advantage if m else 0.0 for m in targets] + [0.0]
            behaviour += [
                lp if m else 0.0 for lp, m in zip(s.behaviour_logprobs, targets, strict=True)
            ]
            behaviour += [0.0]
            if has_ref:
                ref += s.ref_logprobs + [0.0]
            if has_old:
                old += s.old_logprobs + [0.0]
    seq_lens = group_lengths(samples, groups)
    labels_t = torch.tensor([labels])  # [1, T]
    sample_index = torch.tensor(index)  # [T]
    loss_mask = labels_t[0] != IGNORE_INDEX  # [T]
    f32 = torch.float32
    return PackedBatch(
        input_ids=torch.tensor([ids]),  # [1, T]
        position_ids=torch.tensor([pos]),  # [1, T]
        labels=labels_t,
        sample_index=sample_index,
        advantages=torch.tensor(adv, dtype=f32),  # [T]
        behaviour_logprobs=torch.tensor(behaviour, dtype=f32),  # [T]
        ref_logprobs=torch.tensor(ref, dtype=f32) if has_ref else None,  # [T]
        old_logprobs=torch.tensor(old, dtype=f32) if has_old else None,  # [T]
        loss_mask=loss_mask,
        truncated=torch.tensor([s.truncated for s in samples])[sample_index],  # [T]
        seq_lens=seq_lens,
        cu_seqlens=_cu_seqlens(seq_lens),
        num_samples=len(samples),
        num_tokens=int(loss_mask.sum()),
        shared_prefix=torch.tensor(shared) if len(groups) < len(samples) else None,  # [T]
    )


def _check(i: int, s: PackInput) -> None:
    if not s.prompt_ids:
        raise ValueError(f"sample {i}: empty prompt; the first completion token needs a position")
    n_c = len(s.completion_ids)
    for name in ("behaviour_logprobs", "ref_logprobs", "old_logprobs"):
        values = getattr(s, name)
        if values is not None and len(values) != n_c:
            raise ValueError(f"sample {i}: {name} has {len(values)} entries, expected {n_c}")
    if s.completion_mask is not None and len(s.completion_mask) != n_c:
        raise ValueError(
            f"sample {i}: completion_mask has {len(s.completion_mask)} entries, expected {n_c}"
        )


def _cu_seqlens(seq_lens: list[int]) -> Tensor:
    return torch.tensor([0, *seq_lens], dtype=torch.long).cumsum(0).to(torch.int32)  # [N + 1]


def _placeholder(pad_token_id: int) -> PackedBatch:
    zero = torch.zeros(1)  # [1]
    return PackedBatch(
        input_ids=torch.tensor([[pad_token_id]]),
        position_ids=torch.zeros(1, 1, dtype=torch.long),
        labels=torch.full((1, 1), IGNORE_INDEX),
        sample_index=torch.zeros(1, dtype=torch.long),
        advantages=zero,
        behaviour_logprobs=zero.clone(),
        ref_logprobs=zero.clone(),  # so a KL-penalised loss accepts it too
        old_logprobs=None,
        loss_mask=torch.zeros(1, dtype=torch.bool),
        truncated=torch.zeros(1, dtype=torch.bool),
        seq_lens=[1],
        cu_seqlens=_cu_seqlens([1]),
        num_samples=0,
        num_tokens=0,
    )


def pad_to(batch: PackedBatch, length: int, pad_token_id: int = 0) -> PackedBatch:
    """`batch` grown to `length` tokens by one padding segment (its own sample index and
    group, positions from 0, no loss token), so attention keeps it apart and the loss and
    counts ignore it. The same batch when it is already `length` long."""
    t = batch.input_ids.shape[1]
    if length < t:
        raise ValueError(f"cannot pad a row of {t} tokens down to {length}")
    n = length - t
    if n == 0:
        return batch
    dev = batch.input_ids.device

    def grow(x: Tensor | None, fill: Any) -> Tensor | None:  # along the last (token) dim
        if x is None:
            return None
        extra = torch.full((*x.shape[:-1], n), fill, dtype=x.dtype, device=dev)
        return torch.cat([x, extra], dim=-1)

    seq_lens = [*batch.seq_lens, n]
    return replace(
        batch,
        input_ids=grow(batch.input_ids, pad_token_id),  # [1, length]
        position_ids=torch.cat(
            [batch.position_ids, torch.arange(n, device=dev)[None]], dim=1
        ),  # [1, length]
        labels=grow(batch.labels, IGNORE_INDEX),
        sample_index=grow(batch.sample_index, batch.num_samples),
        advantages=grow(batch.advantages, 0.0),
        behaviour_logprobs=grow(batch.behaviour_logprobs, 0.0),
        ref_logprobs=grow(batch.ref_logprobs, 0.0),
        old_logprobs=grow(batch.old_logprobs, 0.0),
        loss_mask=grow(batch.loss_mask, False),
        truncated=grow(batch.truncated, False),
        seq_lens=seq_lens,
        cu_seqlens=_cu_seqlens(seq_lens).to(dev),
        shared_prefix=grow(batch.shared_prefix, False),
    )


def plan_minibatches(lengths: list[int], max_tokens: int, num_ranks: int) -> list[list[list[int]]]:
    """Split samples (by index) into per-rank minibatches of at most `max_tokens` tokens.

    First-fit-decreasing into minibatches (longest sample first, into the first minibatch
    with room), then minibatches are dealt, largest first, to the least-loaded rank that
    still has fewer than ceil(#minibatches / num_ranks). Every rank gets the same number of
    minibatches; ranks that run short get empty ones, which `pack([])` turns into
    placeholders with zero loss (their pass keeps the ranks' collectives in step). No
    samples, no minibatches: a round empty on every rank is never run.
    Returns `plan[rank][minibatch] = [sample indices]`.
    """
    if num_ranks < 1 or max_tokens < 1:
        raise ValueError(f"need num_ranks >= 1 and max_tokens >= 1, got {num_ranks}, {max_tokens}")
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(f"sample {i} has {n} tokens, above max_tokens={max_tokens}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = next((b for b, r in enumerate(room) if r >= lengths[i]), len(bins))
        if b == len(bins):
            bins.append([])
            room.append(max_tokens)
        bins[b].append(i)
        room[b] -= lengths[i]
    depth = -(-len(bins) // num_ranks)
    plan: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for b in sorted(range(len(bins)), key=lambda b: (room[b], b)):  # fullest first
        r = min((r for r in range(num_ranks) if len(plan[r]) < depth), key=lambda r: (load[r], r))
        plan[r].append(bins[b])
        load[r] += max_tokens - room[b]
    for p in plan:
        p += [[] for _ in range(depth - len(p))]
    return plan


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where `allowed`, the dtype's minimum elsewhere: the form eager attention adds."""
    zeros = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return zeros.masked_fill(~allowed, torch.finfo(dtype).min)


def shared_prefix_mask(batch: PackedBatch, window: int | None = None) -> Tensor:
    """Boolean 4D mask [1, 1, T, T] (True = attend) for any row (unshared: block-causal): a query
    sees earlier keys of its own group that are its group's shared prefix or its own sample,
    and with a sliding `window` only those fewer than `window` positions back.
    Boolean, so it suits any compute dtype."""
    group = torch.repeat_interleave(
        torch.arange(len(batch.seq_lens)), torch.tensor(batch.seq_lens)
    ).to(batch.sample_index.device)  # [T]
    t = group.numel()
    shared = batch.shared_prefix  # [T]
    if shared is None:  # an unshared row: each sample sees only itself
        shared = torch.zeros(t, dtype=torch.bool, device=group.device)
    causal = torch.ones(t, t, dtype=torch.bool, device=group.device).tril()  # [T, T]
    own = batch.sample_index[:, None] == batch.sample_index[None, :]  # [T, T]
    allowed = causal & (group[:, None] == group[None, :]) & (shared[None, :] | own)  # [T, T]
    if window is not None:
        pos = batch.position_ids[0].to(group.device)  # [T]
        allowed &= (pos[:, None] - pos[None, :]) < window
    return allowed[None, None]  # [1, 1, T, T]
