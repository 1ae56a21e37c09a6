"""GSPO, CISPO, GMPO, SAPO and the off-policy correction against values worked out by hand
(tolerance 1e-6), on the small batches of test_loss."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from test_loss import BASE, L, _batch, _loss

from async_grpo.config import CorrectionConfig
from async_grpo.core.loss import build_loss, resolved, summarize_metrics
from async_grpo.core.packing import PackInput, pack

SEQ = "seq_mean_token_mean"


def test_each_objective_takes_its_papers_bounds_and_aggregation_when_left_open():
    gspo = resolved(
        replace(BASE, objective="gspo", clip_low=None, clip_high=None, aggregation=None)
    )
    assert (gspo.clip_low, gspo.clip_high, gspo.aggregation) == (3e-4, 4e-4, SEQ)
    ppo = resolved(replace(BASE, clip_low=None, clip_high=None, aggregation=None))
    assert (ppo.clip_low, ppo.clip_high, ppo.aggregation) == (0.2, 0.28, "token_mean")
    gmpo = resolved(replace(BASE, objective="gmpo", clip_low=None, clip_high=0.3))
    assert (gmpo.clip_low, gmpo.clip_high, gmpo.aggregation) == (0.4, 0.3, "token_mean")
    assert build_loss(replace(BASE, objective="gspo", aggregation=None)).aggregation_name == SEQ


def test_gspo_takes_one_length_normalised_ratio_per_sequence():
    cfg = replace(BASE, objective="gspo", aggregation=SEQ)  # bounds [0.8, 1.28]
    batch = _batch(
        {"adv": 1.0, "behaviour": [0.0, 0.0]},  # ratios 1.5, 1 -> s = sqrt(1.5) = 1.2247
        {"adv": -1.0, "behaviour": [0.0]},  # s = 2: A < 0 and above 1 - 0.2, kept
        {"adv": 1.0, "behaviour": [0.0, 0.0]},  # ratios 2, 2 -> s = 2 > 1.28: clipped
    )
    s = math.sqrt(1.5)
    logp = [L(1.5), 0.0, L(2.0), L(2.0), L(2.0)]
    loss, grad, m = _loss(cfg, batch, logp, tokens=5, samples=3)
    # per sample: -s, +2, -1.28; mean over samples (each its token mean)
    assert loss == pytest.approx((-s + 2.0 - 1.28) / 3, abs=1e-6)
    # d s / d logp_t = s / n for each token of the sample: the gradient of the sequence
    # ratio, whichever token it comes from; the clipped sample gives none
    assert grad == pytest.approx([-s / 2 / 3, -s / 2 / 3, 2.0 / 3, 0.0, 0.0], abs=1e-6)
    assert m["clip_high_sum"].item() == 2 and m["clip_low_sum"].item() == 0
    assert m["ratio_sum"].item() == pytest.approx(2 * s + 2.0 + 4.0, abs=1e-6)


def test_cispo_caps_a_detached_weight_and_keeps_every_tokens_gradient():
    cfg = replace(BASE, objective="cispo", cispo_cap=2.0)
    batch = _batch({"adv": 1.0, "behaviour": [0.0, 0.0]}, {"adv": -1.0, "behaviour": [0.0]})
    loss, grad, m = _loss(cfg, batch, [L(3.0), L(0.5), L(0.1)], tokens=3, samples=2)
    # weights min(r, 2) = [2, 0.5, 0.1]; value -A w, gradient -A w d logp
    assert loss == pytest.approx((-2.0 - 0.5 + 0.1) / 3, abs=1e-6)
    # the capped token keeps its gradient (PPO would give it 0), and so does the A < 0 token
    # at ratio 0.1, which PPO's lower clip would cut off
    assert grad == pytest.approx([-2.0 / 3, -0.5 / 3, 0.1 / 3], abs=1e-6)
    assert m["clip_high_sum"].item() == 1  # tokens whose weight the cap cut
    _, ppo_grad, _ = _loss(BASE, batch, [L(3.0), L(0.5), L(0.1)], tokens=3, samples=2)
    assert ppo_grad[0] == 0.0 and ppo_grad[2] == 0.0


def test_gmpo_clips_token_log_ratios_then_takes_their_geometric_mean():
    cfg = replace(BASE, objective="gmpo", clip_low=0.4, clip_high=0.4, aggregation=SEQ)
    batch = _batch({"adv": 1.0, "behaviour": [0.0, 0.0]}, {"adv": -1.0, "behaviour": [0.0, 0.0]})
    loss, grad, m = _loss(cfg, batch, [0.5, -0.1, -0.5, 0.1], tokens=4, samples=2)
    # A > 0: min(dl, clip(dl)) = [0.4, -0.1] -> g = e^0.15; A < 0: max = [-0.4, 0.1] -> e^-0.15
    g_pos, g_neg = math.exp(0.15), math.exp(-0.15)
    assert loss == pytest.approx((-g_pos + g_neg) / 2, abs=1e-6)
    # only unclipped tokens move g: d g / d logp_t = g / n
    assert grad == pytest.approx([0.0, -g_pos / 2 / 2, 0.0, g_neg / 2 / 2], abs=1e-6)
    assert m["clip_high_sum"].item() == 1 and m["clip_low_sum"].item() == 1


def test_gmpo_weighs_each_sample_by_the_geometric_mean_of_its_token_weights():
    """As verl's geo_mean: the ratio is a geometric mean, and so is the correction weight
    of the sample; a product per token would take their arithmetic mean (1.25 here)."""
    cfg = replace(
        BASE,
        objective="gmpo",
        aggregation=SEQ,
        correction=CorrectionConfig(level="token", mode="truncate", cap=2.0),
    )
    # old = logp: the ratio is 1 (g = 1); the token weights exp(old - behaviour) are 0.5, 2
    batch = _batch({"adv": 1.0, "behaviour": [0.0, 0.0], "old": [L(0.5), L(2.0)]})
    loss, grad, _ = _loss(cfg, batch, [L(0.5), L(2.0)], tokens=2, samples=1)
    assert loss == pytest.approx(-1.0, abs=1e-6)  # -A g sqrt(0.5 * 2)
    assert grad == pytest.approx([-0.5, -0.5], abs=1e-6)  # d g / d logp_t = g / n
    # a token the correction masks (weight 0) zeroes its sample's weight
    masked = replace(cfg, correction=CorrectionConfig(level="token", mode="mask", cap=1.5))
    loss, grad, _ = _loss(masked, batch, [L(0.5), L(2.0)], tokens=2, samples=1)
    assert loss == 0.0 and grad == [0.0, 0.0]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_sapo_gates_each_tokens_ratio_with_the_temperature_of_its_advantages_sign():
    cfg = replace(BASE, objective="sapo", aggregation=SEQ)  # tau_pos 1, tau_neg 1.05
    assert resolved(replace(cfg, aggregation=None)).aggregation == SEQ
    batch = _batch({"adv": 1.0, "behaviour": [0.0, 0.0]}, {"adv": -1.0, "behaviour": [0.0]})
    loss, grad, m = _loss(cfg, batch, [L(1.5), 0.0, L(0.5)], tokens=3, samples=2)
    # f(r) = (4 / tau) sigmoid(tau (r - 1)), pg = -A f(r): A > 0 at r = 1.5 and 1 (tau 1),
    # A < 0 at r = 0.5 (tau 1.05); the mean over samples of each one's token mean
    s1, s3 = _sigmoid(0.5), _sigmoid(1.05 * -0.5)
    pos = -(4 * s1 + 4 * 0.5) / 2
    neg = (4 / 1.05) * s3
    assert loss == pytest.approx((pos + neg) / 2, abs=1e-6)
    # d pg / d logp = -A 4 sigmoid' r; weights 1/2 (token mean) and 1/2 (sample mean)
    want = [-4 * s1 * (1 - s1) * 1.5 / 4, -4 * 0.25 / 4, 4 * s3 * (1 - s3) * 0.5 / 2]
    assert grad == pytest.approx(want, abs=1e-6)
    assert "clip_high_sum" not in m and m["ratio_sum"].item() == pytest.approx(3.0, abs=1e-6)
    # at r = 1 the gate's gradient is ppo's; far from 1 it fades where ppo's clip cuts to 0
    _, ppo_grad, _ = _loss(replace(BASE, aggregation=SEQ), batch, [L(1.5), 0.0, L(0.5)], 3, 2)
    assert grad[1] == pytest.approx(ppo_grad[1], abs=1e-9) and ppo_grad[0] == 0.0
    assert 0 < -grad[0] < -ppo_grad[1] * 1.5
    # tau_neg above tau_pos: the same distance from 1 fades faster for A < 0
    hot = replace(cfg, sapo_tau_neg=3.0)
    _, hot_grad, _ = _loss(hot, batch, [L(1.5), 0.0, L(0.5)], tokens=3, samples=2)
    assert 0 < hot_grad[2] < grad[2]


def _corrected(correction, samples, logp, proximal="behaviour", **kw):
    cfg = replace(BASE, correction=correction, proximal=proximal, **kw)
    batch = _batch(*samples)
    n = sum(len(s["behaviour"]) for s in samples)
    return _loss(cfg, batch, logp, tokens=n, samples=len(samples))


def test_sequence_level_weight_is_the_product_of_token_ratios_truncated():
    # old - behaviour = [log 2, log 3]: the sequence weight is 6, truncated to 2 on each
    # token; logp == old, so the PPO term is -A = -1 per token
    old = [-1.0, -1.0]
    sample = {"adv": 1.0, "behaviour": [-1.0 - L(2.0), -1.0 - L(3.0)], "old": old}
    loss, grad, m = _corrected(CorrectionConfig(level="sequence", cap=2.0), [sample], old)
    assert loss == pytest.approx(-2.0, abs=1e-6) and grad == pytest.approx([-1.0, -1.0])
    assert m["is_truncated_sum"].item() == 2 and m["is_weight_max"].item() == pytest.approx(6.0)
    geo = CorrectionConfig(level="geometric", cap=None)  # sqrt(6), untruncated
    loss, _, m = _corrected(geo, [sample], old)
    assert loss == pytest.approx(-math.sqrt(6.0), abs=1e-6)
    assert m["is_weight_sum"].item() == pytest.approx(2 * math.sqrt(6.0), abs=1e-6)


def test_a_mask_zeroes_tokens_or_sequences_outside_its_band():
    old = [-1.0, -1.0, -1.0]
    ratios = [3.0, 0.4, 1.5]
    sample = {"adv": 1.0, "behaviour": [-1.0 - L(r) for r in ratios], "old": old}
    band = CorrectionConfig(mode="mask", floor=0.5, cap=2.0)  # IcePop-like, per token
    loss, grad, m = _corrected(band, [sample], old)
    assert loss == pytest.approx(-1.5 / 3, abs=1e-6)  # weights [0, 0, 1.5]
    assert grad == pytest.approx([0.0, 0.0, -0.5], abs=1e-6)
    assert m["is_masked_sum"].item() == 2 and m["is_truncated_sum"].item() == 0
    # per sequence (TRL's sequence_mask, cap 3): weight 3 * 0.4 * 1.5 = 1.8, kept whole
    seq = CorrectionConfig(level="sequence", mode="mask", cap=3.0)
    loss, _, m = _corrected(seq, [sample], old)
    assert loss == pytest.approx(-1.8, abs=1e-6) and m["is_masked_sum"].item() == 0
    far = dict(sample, behaviour=[-1.0 - L(r) for r in (3.0, 2.0, 1.0)])  # weight 6: masked
    loss, grad, m = _corrected(seq, [far], old)
    assert loss == 0.0 and grad == [0.0] * 3 and m["is_masked_sum"].item() == 3


def test_negative_samples_the_trainer_moved_away_from_are_masked():
    # behaviour - current = [0.15, 0.05]: mean 0.1 past a threshold of 0.08 (the ratios
    # stay inside PPO's bounds, so any zero gradient is the mask's)
    samples = [{"adv": -1.0, "behaviour": [-1.0, -1.0]}, {"adv": 1.0, "behaviour": [-1.0, -1.0]}]
    logp = [-1.15, -1.05, -1.15, -1.05]
    off = CorrectionConfig(mode="off", negative_threshold=0.08)
    loss, grad, m = _corrected(off, samples, logp)
    assert grad[:2] == [0.0, 0.0] and grad[2] != 0.0  # only the A < 0 sample is masked
    assert m["negative_masked_sum"].item() == 2
    loss, grad, m = _corrected(replace(off, negative_threshold=0.12), samples, logp)
    assert all(g != 0.0 for g in grad) and m["negative_masked_sum"].item() == 0


def test_under_proximal_behaviour_every_correction_weight_is_one():
    sample = {"adv": 1.0, "behaviour": [-1.0, -2.0]}
    for c in (
        CorrectionConfig(level="sequence", mode="mask", cap=1.01),
        CorrectionConfig(level="token", cap=1.001),
    ):
        _, _, m = _corrected(c, [sample], [-0.5, -2.5])
        assert m["is_weight_sum"].item() == pytest.approx(2.0, abs=1e-6)
    # under current the same weights apply: exp(logp - behaviour) = [e^0.5, e^-0.5]
    c = CorrectionConfig(level="token", cap=None)
    _, grad, m = _corrected(c, [sample], [-0.5, -2.5], proximal="current")
    assert grad == pytest.approx([-math.exp(0.5) / 2, -math.exp(-0.5) / 2], abs=1e-6)


def test_maxima_pass_through_the_summary():
    out = summarize_metrics({"tokens": 4.0, "is_weight_sum": 4.4, "is_weight_max": 2.5})
    assert out == {"tokens": 4.0, "is_weight_mean": 1.1, "is_weight_max": 2.5}


@pytest.mark.parametrize("proximal", ["behaviour", "current"])  # the ratio's, the weight's
@pytest.mark.parametrize("objective", ["ppo", "gspo", "cispo", "gmpo", "sapo"])
def test_shared_prompts_and_environment_tokens_change_no_sequence_term(objective, proximal):
    """A sequence's terms count its model tokens only: the same samples packed with shared
    prompts, or with environment tokens between their model tokens (a multi-turn mask),
    give the loss and gradients of the plain packing."""
    cfg = replace(
        BASE,
        objective=objective,
        aggregation=SEQ,
        proximal=proximal,
        correction=CorrectionConfig(level="sequence", mode="mask", cap=3.0),
    )
    prompt, logp = [1, 2, 3], [-0.5, -1.5, -0.7, -2.0, -0.1]
    plain = [
        PackInput(prompt, [4, 5, 6], 1.0, [-0.6, -1.2, -0.9]),
        PackInput(prompt, [7, 8], -0.5, [-1.9, -0.3]),
    ]
    env = [  # the second sample's turn had an environment token (9) between its two tokens
        plain[0],
        PackInput(prompt, [7, 9, 8], -0.5, [-1.9, 0.0, -0.3], completion_mask=[True, False, True]),
    ]
    want = _packed_loss(cfg, pack(plain), logp)
    assert any(g != 0.0 for g in want[1:])
    assert _packed_loss(cfg, pack(plain, share_prompts=True), logp) == pytest.approx(want)
    assert _packed_loss(cfg, pack(env), logp) == pytest.approx(want)
    assert _packed_loss(cfg, pack(env, share_prompts=True), logp) == pytest.approx(want)


def _packed_loss(cfg, batch, logp_values):
    loss, grad, _ = _loss(cfg, batch, logp_values, tokens=5, samples=2)
    return [loss, *grad]
