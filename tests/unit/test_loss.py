"""Each loss variant against values worked out by hand (tolerance 1e-6)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from async_grpo.config import CorrectionConfig, LossConfig
from async_grpo.core.loss import build_loss, loss_counts, summarize_metrics
from async_grpo.core.packing import PackedBatch, PackInput, pack

BASE = LossConfig(
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=None,
    kl_coef=0.0,
    entropy_coef=0.0,
    aggregation="token_mean",
    correction=CorrectionConfig(mode="off"),
    proximal="behaviour",  # the ratio against the sampler: the hand values below use it
    mask_truncated=False,
)
CAP2 = CorrectionConfig(cap=2.0)  # token-level truncation at 2 (TIS)
L = math.log


def _batch(*samples: dict) -> PackedBatch:
    """Samples with a one-token prompt; dict keys: adv, behaviour, and optionally old, ref,
    truncated. Loss token k of a sample sits at its position k."""
    return pack(
        [
            PackInput(
                prompt_ids=[1],
                completion_ids=[2] * len(s["behaviour"]),
                advantage=s["adv"],
                behaviour_logprobs=s["behaviour"],
                ref_logprobs=s.get("ref"),
                old_logprobs=s.get("old"),
                truncated=s.get("truncated", False),
            )
            for s in samples
        ]
    )


def _per_loss_token(batch: PackedBatch, values: list[float]) -> torch.Tensor:
    """A [T] tensor with `values` on the loss tokens, in order, and 0 elsewhere."""
    out = torch.zeros(batch.loss_mask.shape[0])  # [T]
    out[batch.loss_mask] = torch.tensor(values)
    return out


def _loss(cfg, batch, logp_values, tokens, samples, **kw):
    logp = _per_loss_token(batch, logp_values).requires_grad_()  # [T]
    loss, metrics = build_loss(cfg)(logp, batch, tokens, samples, **kw)
    loss.backward()
    return loss.item(), logp.grad[batch.loss_mask].tolist(), metrics


def test_clip_low_and_clip_high():
    # behaviour 0 so ratio = exp(logp); clip to [0.8, 1.28]
    batch = _batch({"adv": 1.0, "behaviour": [0.0] * 3}, {"adv": -2.0, "behaviour": [0.0] * 3})
    ratios = [1.5, 1.1, 0.5, 0.5, 1.5, 0.9]
    loss, grad, m = _loss(BASE, batch, [L(r) for r in ratios], tokens=6, samples=2)
    # A=+1: r=1.5 -> max(-1.5, -1.28) = -1.28 (clip high); r=1.1 -> -1.1; r=0.5 -> -0.5
    # A=-2: r=0.5 -> max(1.0, 1.6) = 1.6 (clip low); r=1.5 -> max(3.0, 2.56) = 3.0; r=0.9 -> 1.8
    # sum = -1.28 - 1.1 - 0.5 + 1.6 + 3.0 + 1.8 = 3.52; token mean 3.52 / 6
    assert loss == pytest.approx(3.52 / 6, abs=1e-6)
    # d/dlogp of -A r is -A r where unclipped, 0 where clipped; all / 6
    want = [0.0, -1.1 / 6, -0.5 / 6, 0.0, 3.0 / 6, 1.8 / 6]
    assert grad == pytest.approx(want, abs=1e-6)
    assert m["clip_high_sum"].item() == 1 and m["clip_low_sum"].item() == 1
    assert m["ratio_sum"].item() == pytest.approx(6.0, abs=1e-6)  # 1.5+1.1+0.5+0.5+1.5+0.9


def test_dual_clip():
    cfg = replace(BASE, dual_clip=3.0)
    batch = _batch({"adv": -1.0, "behaviour": [0.0, 0.0]}, {"adv": 1.0, "behaviour": [0.0]})
    loss, grad, m = _loss(cfg, batch, [L(5.0), L(2.0), L(5.0)], tokens=3, samples=2)
    # A=-1, r=5: PPO gives max(5, 1.28) = 5, dual clip caps at -3 * A = 3
    # A=-1, r=2: max(2, 1.28) = 2 < 3, kept; A=+1, r=5: max(-5, -1.28) = -1.28 (no dual clip)
    # (3 + 2 - 1.28) / 3 = 1.24
    assert loss == pytest.approx(1.24, abs=1e-6)
    assert grad == pytest.approx([0.0, 2.0 / 3, 0.0], abs=1e-6)  # only r=2 is unclipped
    assert m["dual_clip_sum"].item() == 1


@pytest.mark.parametrize(
    "estimator, want",
    [
        # logp - ref = [0.5, -1.0]
        ("k1", 0.1 * (0.5 - 1.0) / 2),  # -0.025
        ("k2", 0.1 * (0.5 * 0.25 + 0.5 * 1.0) / 2),  # 0.03125
        # d = ref - logp = [-0.5, 1.0]: e^-0.5 + 0.5 - 1 = 0.1065307, e^1 - 1 - 1 = 0.7182818
        ("k3", 0.1 * (0.10653066 + 0.71828183) / 2),  # 0.0412406
    ],
)
def test_kl_estimators(estimator, want):
    cfg = replace(BASE, kl_coef=0.1, kl_estimator=estimator)
    # adv 0 and logp == behaviour: the policy term is 0, only the KL remains
    batch = _batch({"adv": 0.0, "behaviour": [-1.0, -2.0], "ref": [-1.5, -1.0]})
    loss, _, m = _loss(cfg, batch, [-1.0, -2.0], tokens=2, samples=1)
    assert loss == pytest.approx(want, abs=1e-6)
    assert m["kl_sum"].item() == pytest.approx(want * 2 / 0.1, abs=1e-6)


def test_kl_needs_ref_only_when_enabled():
    batch = _batch({"adv": 1.0, "behaviour": [0.0]})
    _loss(BASE, batch, [0.0], tokens=1, samples=1)  # kl_coef 0: no ref needed
    with pytest.raises(ValueError, match="no ref_logprobs"):
        _loss(replace(BASE, kl_coef=0.1), batch, [0.0], tokens=1, samples=1)


def test_entropy_bonus():
    cfg = replace(BASE, entropy_coef=0.01)
    batch = _batch({"adv": 0.0, "behaviour": [0.0, 0.0]})
    entropy = _per_loss_token(batch, [2.0, 3.0])
    loss, _, m = _loss(cfg, batch, [0.0, 0.0], tokens=2, samples=1, entropy=entropy)
    assert loss == pytest.approx(-0.01 * (2.0 + 3.0) / 2, abs=1e-6)  # -0.025
    assert m["entropy_sum"].item() == pytest.approx(5.0)
    with pytest.raises(ValueError, match="no entropy was passed"):
        _loss(cfg, batch, [0.0, 0.0], tokens=2, samples=1)


# ratio 1 everywhere, so each token's loss is -A: sample 0 has 3 tokens of -1, sample 1 one of +2
AGG_BATCH = ({"adv": 1.0, "behaviour": [0.0] * 3}, {"adv": -2.0, "behaviour": [0.0]})


@pytest.mark.parametrize(
    "aggregation, tokens, samples, world_size, want",
    [
        ("token_mean", 4, 2, 1, (-3 + 2) / 4),  # -0.25
        ("token_mean", 10, 5, 1, (-3 + 2) / 10),  # global count from other minibatches
        ("token_mean", 10, 5, 2, 2 * (-3 + 2) / 10),  # averaging all-reduce over 2 ranks
        ("seq_mean_token_mean", 4, 2, 1, (-3 / 3 + 2 / 1) / 2),  # 0.5
        ("seq_mean_token_mean", 10, 5, 1, (-3 / 3 + 2 / 1) / 5),  # 0.2
        ("seq_sum_constant", 4, 2, 1, (-3 + 2) / (2 * 8)),  # constant 8: -0.0625
    ],
)
def test_aggregations(aggregation, tokens, samples, world_size, want):
    cfg = replace(BASE, aggregation=aggregation, constant_normalizer=8.0)
    batch = _batch(*AGG_BATCH)
    loss, _, _ = _loss(cfg, batch, [0.0] * 4, tokens, samples, world_size=world_size)
    assert loss == pytest.approx(want, abs=1e-6)


def test_truncated_importance_sampling():
    # logp == old so the PPO ratio is 1 and each token's PPO loss is -A = -1
    # old - behaviour = [log 3, log 0.5, 0] -> weights [min(3, 2), 0.5, 1] = [2, 0.5, 1]
    old = [-1.0, -2.0, -0.5]
    behaviour = [o - d for o, d in zip(old, [L(3.0), L(0.5), 0.0], strict=True)]
    batch = _batch({"adv": 1.0, "behaviour": behaviour, "old": old})
    loss, grad, m = _loss(replace(BASE, correction=CAP2), batch, old, tokens=3, samples=1)
    assert loss == pytest.approx(-(2 + 0.5 + 1) / 3, abs=1e-6)  # -1.1666667
    assert grad == pytest.approx([-2 / 3, -0.5 / 3, -1 / 3], abs=1e-6)  # w * (-A r) / 3
    assert m["is_weight_sum"].item() == pytest.approx(3.5, abs=1e-6)
    loss, _, m = _loss(BASE, batch, old, tokens=3, samples=1)  # correction off: weights 1
    assert loss == pytest.approx(-(1 + 1 + 1) / 3, abs=1e-6)  # -1.0
    assert m["is_weight_sum"].item() == pytest.approx(3.0, abs=1e-6)
    # without old log-probs, ratio and weight both use behaviour: weight 1, ratio exp(0.7)
    plain = _batch({"adv": 1.0, "behaviour": [-1.0]})
    loss, _, _ = _loss(replace(BASE, correction=CAP2), plain, [-0.3], tokens=1, samples=1)
    assert loss == pytest.approx(-1.28, abs=1e-6)  # ratio e^0.7 = 2.01 clipped to 1.28


def test_mask_truncated():
    batch = _batch(
        {"adv": 1.0, "behaviour": [0.0, 0.0], "truncated": True},
        {"adv": -1.0, "behaviour": [0.0]},
    )
    assert loss_counts(batch, mask_truncated=False) == (3, 2)
    assert loss_counts(batch, mask_truncated=True) == (1, 1)  # truncated sample not counted
    loss, grad, _ = _loss(BASE, batch, [0.0] * 3, tokens=3, samples=2)
    assert loss == pytest.approx((-1 - 1 + 1) / 3, abs=1e-6)
    cfg = replace(BASE, mask_truncated=True)
    loss, grad, m = _loss(cfg, batch, [0.0] * 3, tokens=1, samples=1)
    assert loss == pytest.approx(1.0, abs=1e-6)  # only the +1 of sample 1, over 1 token
    assert grad[:2] == [0.0, 0.0] and m["tokens"].item() == 1


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_sum_constant"])
def test_placeholder_and_junk_off_mask_give_finite_zero(aggregation):
    cfg = replace(BASE, aggregation=aggregation, constant_normalizer=8.0, kl_coef=0.1)
    empty = pack([])
    logp = torch.full((1,), 1000.0, requires_grad=True)  # junk where there is no loss token
    loss, _ = build_loss(cfg)(logp, empty, 0, 0)
    loss.backward()
    assert loss.item() == 0.0 and logp.grad.tolist() == [0.0]
    batch = _batch({"adv": 1.0, "behaviour": [0.0], "ref": [0.0]})
    logp = torch.tensor([0.0, 1000.0], requires_grad=True)  # position 1 is off the mask
    loss, _ = build_loss(cfg)(logp, batch, 1, 1)
    loss.backward()
    assert math.isfinite(loss.item()) and logp.grad[1].item() == 0.0


def test_proximal_current_is_decoupled_ppo_with_one_update():
    # the trainer's log-probs logp = [-1, -2, -0.5] are the proximal policy: ratio 1, so no
    # clip; logp - behaviour = [log 3, log 0.5, 0] -> tis [min(3, 2), 0.5, 1] = [2, 0.5, 1]
    logp = [-1.0, -2.0, -0.5]
    behaviour = [o - d for o, d in zip(logp, [L(3.0), L(0.5), 0.0], strict=True)]
    batch = _batch({"adv": 1.0, "behaviour": behaviour})
    cfg = replace(BASE, correction=CAP2, proximal="current")
    loss, grad, m = _loss(cfg, batch, logp, tokens=3, samples=1)
    assert loss == pytest.approx(-(2 + 0.5 + 1) / 3, abs=1e-6)
    assert grad == pytest.approx([-2 / 3, -0.5 / 3, -1 / 3], abs=1e-6)
    assert m["is_weight_sum"].item() == pytest.approx(3.5, abs=1e-6)
    assert m["ratio_sum"].item() == pytest.approx(3.0, abs=1e-6)
    assert m["clip_high_sum"].item() == 0  # ratio e^(log 3) would have been clipped
    # mismatch: |d| = [log 3, log 2, 0]; k3 = e^d - 1 - d = [2 - log 3, log 2 - 0.5, 0]
    assert m["mismatch_abs_sum"].item() == pytest.approx(L(3.0) + L(2.0), abs=1e-6)
    k3 = (3 - 1 - L(3.0)) + (0.5 - 1 - L(0.5))
    assert m["mismatch_k3_sum"].item() == pytest.approx(k3, abs=1e-6)
    # the same batch under "behaviour": ratio [3, 0.5, 1] against the sampler, tis 1
    loss, grad, m = _loss(replace(cfg, proximal="behaviour"), batch, logp, tokens=3, samples=1)
    assert loss == pytest.approx(-(1.28 + 0.5 + 1) / 3, abs=1e-6)  # 3 clipped to 1.28
    assert grad == pytest.approx([0.0, -0.5 / 3, -1 / 3], abs=1e-6)
    assert m["is_weight_sum"].item() == pytest.approx(3.0, abs=1e-6)
    assert m["mismatch_abs_sum"].item() == pytest.approx(L(3.0) + L(2.0), abs=1e-6)


def test_summarize_metrics_and_build_loss():
    sums = {"tokens": 4.0, "clip_low_sum": 1.0, "dual_clip_sum": 2.0, "ratio_sum": 4.4}
    assert summarize_metrics(sums) == pytest.approx(
        {"tokens": 4.0, "clip_low_frac": 0.25, "dual_clip_frac": 0.5, "ratio_mean": 1.1}
    )
    dr = replace(BASE, aggregation="seq_sum_constant", constant_normalizer=None)
    with pytest.raises(ValueError, match="seq_sum_constant"):
        build_loss(dr)
    assert build_loss(dr, max_new_tokens=128).constant_normalizer == 128.0
