"""Loss terms against NumPy references written from the formulas (not from the code)."""

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl.learner.losses import LossConfig, aggregate, clipped_objective, policy_loss, sft_loss
from marin_rl.types import RlExample

B, P = hax.Axis("batch", 2), hax.Axis("position", 8)


def _example(rng, with_prox=False):
    mask = rng.random((2, 8)) < 0.6
    seg = np.array([[0, 0, 0, 1, 1, 1, 1, -1], [0, 0, 0, 0, 0, 1, 1, 1]])
    mask &= seg >= 0
    ex = RlExample(
        input_ids=hax.named(np.zeros((2, 8), np.int32), (B, P)),
        position_ids=hax.named(np.zeros((2, 8), np.int32), (B, P)),
        segment_ids=hax.named(seg.astype(np.int32), (B, P)),
        loss_mask=hax.named(mask, (B, P)),
        advantages=hax.named(rng.normal(size=(2, 8)).astype(np.float32), (B, P)),
        policy_logprobs=hax.named(-rng.random((2, 8)).astype(np.float32) * 3, (B, P)),
        version=hax.named(np.zeros((2, 8), np.int32), (B, P)),
        proximal_logprobs=hax.named(-rng.random((2, 8)).astype(np.float32) * 3, (B, P)) if with_prox else None,
    )
    return ex


def _np_clip_obj(lp, old, adv, lo, hi):
    r = np.exp(lp - old)
    return np.minimum(r * adv, np.clip(r, 1 - lo, 1 + hi) * adv)


def _np_aggregate(x, mask, seg, kind, budget):
    m = mask.astype(np.float64)
    if kind == "token_mean":
        return (x * m).sum() / m.sum()
    per_seq = []
    for b in range(x.shape[0]):
        for s in np.unique(seg[b][seg[b] >= 0]):
            sel = (seg[b] == s) & mask[b]
            if sel.any():
                per_seq.append((x[b][sel].sum(), sel.sum()))
    if kind == "sequence_mean":
        return np.mean([s / n for s, n in per_seq])
    return sum(s for s, _ in per_seq) / (len(per_seq) * budget)


def test_clipped_objective_matches_formula():
    rng = np.random.default_rng(0)
    lp, old, adv = rng.normal(size=50) * 0.5 - 2, rng.normal(size=50) * 0.5 - 2, rng.normal(size=50)
    got, ratio = clipped_objective(jnp.asarray(lp), jnp.asarray(old), jnp.asarray(adv), 0.2, 0.28)
    np.testing.assert_allclose(np.asarray(got), _np_clip_obj(lp, old, adv, 0.2, 0.28), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ratio), np.exp(lp - old), rtol=1e-5)


@pytest.mark.parametrize("kind", ["token_mean", "sequence_mean", "fixed_budget"])
def test_aggregations_match_reference(kind):
    rng = np.random.default_rng(1)
    ex = _example(rng)
    x = rng.normal(size=(2, 8)).astype(np.float32)
    mask, seg = np.asarray(ex.loss_mask.array), np.asarray(ex.segment_ids.array)
    got = aggregate(jnp.asarray(x), jnp.asarray(mask), jnp.asarray(seg), kind, 16)
    np.testing.assert_allclose(float(got), _np_aggregate(x, mask, seg, kind, 16), rtol=1e-5)


def test_ppo_objective_uses_sampler_logprobs():
    rng = np.random.default_rng(2)
    ex = _example(rng)
    lp = rng.normal(size=(2, 8)).astype(np.float32) * 0.3 - 1.5
    cfg = LossConfig(objective="ppo", clip_low=0.2, clip_high=0.3)
    loss, _ = policy_loss(hax.named(lp, (B, P)), hax.named(np.zeros((2, 8), np.float32), (B, P)), ex, cfg)
    obj = _np_clip_obj(lp, np.asarray(ex.policy_logprobs.array), np.asarray(ex.advantages.array), 0.2, 0.3)
    mask = np.asarray(ex.loss_mask.array)
    np.testing.assert_allclose(float(loss), -(obj * mask).sum() / mask.sum(), rtol=1e-5)


def test_decoupled_objective_with_behaviour_weight_and_cap():
    rng = np.random.default_rng(3)
    ex = _example(rng, with_prox=True)
    lp = rng.normal(size=(2, 8)).astype(np.float32) * 0.3 - 1.5
    cfg = LossConfig(objective="decoupled", clip_low=0.2, clip_high=0.28, behaviour_weight_cap=2.0)
    loss, metrics = policy_loss(hax.named(lp, (B, P)), hax.named(np.zeros((2, 8), np.float32), (B, P)), ex, cfg)
    prox, behav = np.asarray(ex.proximal_logprobs.array), np.asarray(ex.policy_logprobs.array)
    adv, mask = np.asarray(ex.advantages.array), np.asarray(ex.loss_mask.array)
    w = np.exp(prox - behav)
    kept = mask & (w <= 2.0)
    per_tok = -w * _np_clip_obj(lp, prox, adv, 0.2, 0.28)
    np.testing.assert_allclose(float(loss), (per_tok * kept).sum() / kept.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["masked_frac"]), 1 - kept.sum() / mask.sum(), rtol=1e-6)


def test_decoupled_gradient_is_weighted_policy_gradient():
    """Without proximal logprobs the ratio is 1 and d(loss)/d(logp) = -w·A / N on kept tokens."""
    rng = np.random.default_rng(4)
    ex = _example(rng)
    lp0 = rng.normal(size=(2, 8)).astype(np.float32) * 0.3 - 1.5
    cfg = LossConfig(objective="decoupled", behaviour_weight_cap=1e9)

    def f(lp):
        return policy_loss(hax.named(lp, (B, P)), hax.named(jnp.zeros((2, 8)), (B, P)), ex, cfg)[0]

    grad = np.asarray(jax.grad(f)(jnp.asarray(lp0)))
    mask, adv = np.asarray(ex.loss_mask.array), np.asarray(ex.advantages.array)
    w = np.exp(lp0 - np.asarray(ex.policy_logprobs.array))
    expected = np.where(mask, -w * adv / mask.sum(), 0.0)
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-7)
    _, metrics = policy_loss(hax.named(lp0, (B, P)), hax.named(jnp.zeros((2, 8)), (B, P)), ex, cfg)
    assert float(metrics["ratio/mean"]) == 1.0 and float(metrics["ratio/max"]) == 1.0


def test_sft_loss_is_masked_nll():
    rng = np.random.default_rng(5)
    lp = -rng.random((2, 8)).astype(np.float32)
    mask = rng.random((2, 8)) < 0.5
    got = sft_loss(hax.named(lp, (B, P)), hax.named(mask, (B, P)))
    np.testing.assert_allclose(float(got), -(lp * mask).sum() / mask.sum(), rtol=1e-6)


def test_bad_loss_config_is_rejected():
    with pytest.raises(ValueError, match="aggregation"):
        LossConfig(aggregation="mean_of_means")
    with pytest.raises(ValueError, match="objective"):
        LossConfig(objective="grpo")
