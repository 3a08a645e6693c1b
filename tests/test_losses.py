"""Loss terms against NumPy references written from the formulas (not from the code)."""

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl.learner.batch import RlExample
from marin_rl.learner.config import LossConfig
from marin_rl.learner.losses import (
    aggregate,
    clipped_objective,
    combine_metrics,
    loss_normalizers,
    policy_loss,
    sft_loss,
)
from marin_rl.model.logprobs import token_logprobs

B, P = hax.Axis("batch", 2), hax.Axis("position", 8)


def _example(rng, with_prox=False, with_ref=False):
    mask = rng.random((2, 8)) < 0.6
    seg = np.array([[0, 0, 0, 1, 1, 1, 1, -1], [0, 0, 0, 0, 0, 1, 1, 1]])
    mask &= seg >= 0
    ex = RlExample(
        input_ids=hax.named(np.zeros((2, 8), np.int32), (B, P)),
        position_ids=hax.named(np.zeros((2, 8), np.int32), (B, P)),
        segment_ids=hax.named(seg.astype(np.int32), (B, P)),
        loss_mask=hax.named(mask, (B, P)),
        advantages=hax.named(rng.normal(size=(2, 8)).astype(np.float32), (B, P)),
        sampler_logprobs=hax.named(-rng.random((2, 8)).astype(np.float32) * 3, (B, P)),
        token_versions=hax.named(np.zeros((2, 8), np.int32), (B, P)),
        proximal_logprobs=hax.named(-rng.random((2, 8)).astype(np.float32) * 3, (B, P)) if with_prox else None,
        reference_logprobs=hax.named(-rng.random((2, 8)).astype(np.float32) * 3, (B, P)) if with_ref else None,
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
    obj = _np_clip_obj(lp, np.asarray(ex.sampler_logprobs.array), np.asarray(ex.advantages.array), 0.2, 0.3)
    mask = np.asarray(ex.loss_mask.array)
    np.testing.assert_allclose(float(loss), -(obj * mask).sum() / mask.sum(), rtol=1e-5)


def test_decoupled_objective_with_sampler_weight_and_cap():
    rng = np.random.default_rng(3)
    ex = _example(rng, with_prox=True)
    lp = rng.normal(size=(2, 8)).astype(np.float32) * 0.3 - 1.5
    cfg = LossConfig(objective="decoupled", clip_low=0.2, clip_high=0.28, sampler_weight_cap=2.0)
    loss, metrics = policy_loss(hax.named(lp, (B, P)), hax.named(np.zeros((2, 8), np.float32), (B, P)), ex, cfg)
    prox, sampler = np.asarray(ex.proximal_logprobs.array), np.asarray(ex.sampler_logprobs.array)
    adv, mask = np.asarray(ex.advantages.array), np.asarray(ex.loss_mask.array)
    w = np.exp(prox - sampler)
    kept = mask & (w <= 2.0)
    per_tok = -w * _np_clip_obj(lp, prox, adv, 0.2, 0.28)
    np.testing.assert_allclose(float(loss), (per_tok * kept).sum() / kept.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["masked_frac"]), 1 - kept.sum() / mask.sum(), rtol=1e-6)


def test_decoupled_gradient_is_weighted_policy_gradient():
    """Without proximal logprobs the ratio is 1 and d(loss)/d(logp) = -w·A / N on kept tokens."""
    rng = np.random.default_rng(4)
    ex = _example(rng)
    lp0 = rng.normal(size=(2, 8)).astype(np.float32) * 0.3 - 1.5
    cfg = LossConfig(objective="decoupled", sampler_weight_cap=1e9)

    def f(lp):
        return policy_loss(hax.named(lp, (B, P)), hax.named(jnp.zeros((2, 8)), (B, P)), ex, cfg)[0]

    grad = np.asarray(jax.grad(f)(jnp.asarray(lp0)))
    mask, adv = np.asarray(ex.loss_mask.array), np.asarray(ex.advantages.array)
    w = np.exp(lp0 - np.asarray(ex.sampler_logprobs.array))
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
    with pytest.raises(ValueError, match="tis_cap"):
        LossConfig(tis_cap=0.0)
    with pytest.raises(ValueError, match="kl_coef"):
        LossConfig(kl_coef=-0.1)
    with pytest.raises(ValueError, match="kl_estimator"):
        LossConfig(kl_estimator="k4")


def _zeros():
    return hax.named(np.zeros((2, 8), np.float32), (B, P))


@pytest.mark.parametrize("objective", ["ppo", "decoupled"])
def test_truncated_importance_sampling_matches_formula(objective):
    """w = min(exp(logp_prox - logp_sampler), C) times min(r·A, clip(r)·A), r = exp(logp - logp_prox); no masking."""
    rng = np.random.default_rng(6)
    ex = _example(rng, with_prox=True)
    lp = rng.normal(size=(2, 8)).astype(np.float32) * 0.3 - 1.5
    cfg = LossConfig(objective=objective, clip_low=0.2, clip_high=0.28, tis_cap=1.5, sampler_weight_cap=1.0)
    loss, metrics = policy_loss(hax.named(lp, (B, P)), _zeros(), ex, cfg)
    prox, sampler = np.asarray(ex.proximal_logprobs.array), np.asarray(ex.sampler_logprobs.array)
    adv, mask = np.asarray(ex.advantages.array), np.asarray(ex.loss_mask.array)
    w = np.minimum(np.exp(prox - sampler), 1.5)
    assert (np.exp(prox - sampler)[mask] > 1.5).any() and (np.exp(prox - sampler)[mask] < 1.5).any()
    per_tok = -w * _np_clip_obj(lp, prox, adv, 0.2, 0.28)
    np.testing.assert_allclose(float(loss), (per_tok * mask).sum() / mask.sum(), rtol=1e-5)
    assert float(metrics["masked_frac"]) == 0.0
    np.testing.assert_allclose(
        float(metrics["tis/truncated_frac"]), (np.exp(prox - sampler) > 1.5)[mask].mean(), rtol=1e-6
    )


def test_truncated_importance_sampling_gradient_without_proximal_logprobs():
    """Without proximal logprobs, logp_prox = stop_gradient(logp).

    Then d(loss)/d(logp) = -min(exp(logp - logp_sampler), C)·A/N on sampled tokens.
    """
    rng = np.random.default_rng(7)
    ex = _example(rng)
    lp0 = rng.normal(size=(2, 8)).astype(np.float32) * 0.3 - 1.5
    cfg = LossConfig(objective="ppo", tis_cap=2.0)

    def f(lp):
        return policy_loss(hax.named(lp, (B, P)), _zeros(), ex, cfg)[0]

    grad = np.asarray(jax.grad(f)(jnp.asarray(lp0)))
    mask, adv = np.asarray(ex.loss_mask.array), np.asarray(ex.advantages.array)
    w = np.minimum(np.exp(lp0 - np.asarray(ex.sampler_logprobs.array)), 2.0)
    np.testing.assert_allclose(grad, np.where(mask, -w * adv / mask.sum(), 0.0), rtol=1e-4, atol=1e-7)


def _np_kl(lp, ref, estimator):
    x = ref.astype(np.float64) - lp
    return {"k1": -x, "k2": x**2 / 2, "k3": np.exp(x) - 1 - x}[estimator]


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("kind", ["token_mean", "sequence_mean"])
def test_kl_to_reference_matches_formula(estimator, kind):
    rng = np.random.default_rng(8)
    ex = _example(rng, with_ref=True)
    lp = rng.normal(size=(2, 8)).astype(np.float32) * 0.3 - 1.5
    cfg = LossConfig(objective="ppo", aggregation=kind, kl_coef=0.3, kl_estimator=estimator)
    loss, metrics = policy_loss(hax.named(lp, (B, P)), _zeros(), ex, cfg)
    mask, seg = np.asarray(ex.loss_mask.array), np.asarray(ex.segment_ids.array)
    kl = _np_aggregate(_np_kl(lp, np.asarray(ex.reference_logprobs.array), estimator), mask, seg, kind, 128)
    obj = _np_clip_obj(lp, np.asarray(ex.sampler_logprobs.array), np.asarray(ex.advantages.array), 0.2, 0.28)
    pg = _np_aggregate(-obj, mask, seg, kind, 128)
    np.testing.assert_allclose(float(metrics["kl_reference"]), kl, rtol=1e-5)
    np.testing.assert_allclose(float(loss), pg + 0.3 * kl, rtol=1e-5)


def test_k3_gradient_matches_formula():
    """d/d(logp) of β·mean(exp(x) - 1 - x), x = logp_ref - logp, is β·(1 - exp(x))/N on sampled tokens."""
    rng = np.random.default_rng(9)
    ex = _example(rng, with_ref=True)
    ex = RlExample(**{**ex.__dict__, "advantages": _zeros()})  # no policy-gradient term
    lp0 = rng.normal(size=(2, 8)).astype(np.float32) * 0.3 - 1.5
    cfg = LossConfig(objective="ppo", kl_coef=0.7, kl_estimator="k3")
    grad = np.asarray(jax.grad(lambda lp: policy_loss(hax.named(lp, (B, P)), _zeros(), ex, cfg)[0])(jnp.asarray(lp0)))
    mask = np.asarray(ex.loss_mask.array)
    x = np.asarray(ex.reference_logprobs.array) - lp0
    np.testing.assert_allclose(grad, np.where(mask, 0.7 * (1 - np.exp(x)) / mask.sum(), 0.0), rtol=1e-4, atol=1e-7)


def test_kl_penalty_needs_reference_logprobs():
    ex = _example(np.random.default_rng(10))
    with pytest.raises(ValueError, match="reference_logprobs"):
        policy_loss(_zeros(), _zeros(), ex, LossConfig(kl_coef=0.1))


def _row(ex, b):
    one = hax.Axis("batch", 1)
    return RlExample(
        **{k: None if v is None else hax.named(v.array[b : b + 1], (one, P)) for k, v in ex.__dict__.items()}
    )


@pytest.mark.parametrize("kind", ["token_mean", "sequence_mean", "fixed_budget"])
@pytest.mark.parametrize("objective", ["decoupled", "ppo"])
def test_row_slices_with_batch_normalizers_add_up_to_the_batch(kind, objective):
    """Gradient accumulation: per-row losses and metrics normalised by the whole batch sum to the batch's."""
    rng = np.random.default_rng(11)
    ex = _example(rng, with_prox=True, with_ref=True)
    lp = hax.named(rng.normal(size=(2, 8)).astype(np.float32) * 0.3 - 1.5, (B, P))
    ent = hax.named(rng.random((2, 8)).astype(np.float32), (B, P))
    cfg = LossConfig(objective=objective, aggregation=kind, sampler_weight_cap=1.5, kl_coef=0.2, max_response_tokens=4)
    loss, metrics = policy_loss(lp, ent, ex, cfg)
    norm = loss_normalizers(ex, cfg)
    one = hax.Axis("batch", 1)
    parts = [
        policy_loss(
            hax.named(lp.array[b : b + 1], (one, P)), hax.named(ent.array[b : b + 1], (one, P)), _row(ex, b), cfg, norm
        )
        for b in range(2)
    ]
    np.testing.assert_allclose(sum(float(p[0]) for p in parts), float(loss), rtol=1e-5)
    combined = combine_metrics({k: jnp.stack([p[1][k] for p in parts]) for k in metrics})
    for k in metrics:
        np.testing.assert_allclose(float(combined[k]), float(metrics[k]), rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.parametrize(
    "config",
    [
        LossConfig(objective="decoupled", kl_coef=0.1),
        LossConfig(objective="ppo", kl_coef=0.1, kl_estimator="k2"),
        LossConfig(objective="ppo", tis_cap=2.0, aggregation="sequence_mean"),
        LossConfig(objective="decoupled", aggregation="fixed_budget"),
    ],
)
def test_masked_positions_contribute_exactly_zero_whatever_they_hold(config):
    """NaN, ±inf and extreme log-probs at masked positions (sampler, proximal, reference, advantages, even the
    learner's own logprobs): the loss, every metric and the gradient are finite and equal to those of the same batch
    with benign values there."""
    rng = np.random.default_rng(21)
    benign = _example(rng, with_prox=True, with_ref=True)
    mask = np.asarray(benign.loss_mask.array)
    junk = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 88.0, -1e4], np.float32)

    def poison(x):
        arr = np.array(x.array, np.float32)
        arr[~mask] = junk[np.arange((~mask).sum()) % len(junk)]
        return hax.named(arr, x.axes)

    fields = ("advantages", "sampler_logprobs", "proximal_logprobs", "reference_logprobs")
    poisoned = dataclasses.replace(benign, **{f: poison(getattr(benign, f)) for f in fields})
    logp = hax.named(-rng.random((2, 8)).astype(np.float32) * 2, (B, P))
    entropy = hax.named(rng.random((2, 8)).astype(np.float32), (B, P))

    def loss_and_grad(ex, lp):
        def f(x):
            return policy_loss(hax.named(x, (B, P)), entropy, ex, config)

        (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(lp.array)
        return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)

    ref_loss, ref_metrics, ref_grad = loss_and_grad(benign, logp)
    loss, metrics, grad = loss_and_grad(poisoned, poison(logp))
    assert np.isfinite(ref_loss) and np.isfinite(ref_grad).all()
    assert loss == ref_loss and metrics == ref_metrics
    np.testing.assert_array_equal(grad, ref_grad)
    assert (grad[~mask] == 0).all()


class _FixedLogits(eqx.Module):
    """A 'model' whose logits are its parameters (one vector per position), whatever the input."""

    logits: jnp.ndarray
    Vocab: hax.Axis = eqx.field(static=True)

    def __call__(self, input_ids, attn_mask=None, pos_ids=None):
        return hax.named(self.logits, (*input_ids.axes, self.Vocab))


@pytest.mark.parametrize("kind", ["token_mean", "sequence_mean"])
def test_entropy_bonus_value_and_gradient_match_formula(kind):
    """With zero advantages the loss is -c·aggregate(H); H_t comes from the logits at t-1 through `token_logprobs`,
    and dH/dz_k = -p_k (z_k - Σ_v p_v z_v), so the gradient of the logits is known in closed form."""
    rng = np.random.default_rng(12)
    ex = RlExample(**{**_example(rng).__dict__, "advantages": _zeros()})
    vocab = hax.Axis("vocab", 5)
    z0 = rng.normal(size=(2, 8, 5)).astype(np.float32) * 2
    cfg = LossConfig(objective="ppo", aggregation=kind, entropy_coef=0.05)

    def loss_of(z):
        lp, ent = token_logprobs(_FixedLogits(z, vocab), ex.input_ids, ex.position_ids, ex.segment_ids)
        return policy_loss(lp, ent, ex, cfg)

    (loss, metrics), grad = jax.value_and_grad(loss_of, has_aux=True)(jnp.asarray(z0))
    mask, seg = np.asarray(ex.loss_mask.array), np.asarray(ex.segment_ids.array)
    z = z0.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    h = -(p * np.log(p)).sum(-1)  # entropy of the distribution the logits at each position give
    h_tok = np.concatenate([np.zeros((2, 1)), h[:, :-1]], axis=1)  # token t is sampled from the logits at t-1
    bonus = _np_aggregate(h_tok, mask, seg, kind, 128)
    np.testing.assert_allclose(float(metrics["entropy_bonus"]), bonus, rtol=1e-5)
    np.testing.assert_allclose(float(loss), -0.05 * bonus, rtol=1e-5)
    # d(-c·aggregate(H))/dH_t = -c·a_t, with a_t the aggregation's weight of token t; then the chain rule to z[t-1]
    if kind == "token_mean":
        a = mask / mask.sum()
    else:
        a = np.zeros((2, 8))
        seqs = [(b, s) for b in range(2) for s in np.unique(seg[b][seg[b] >= 0]) if (mask[b] & (seg[b] == s)).any()]
        for b, s in seqs:
            sel = mask[b] & (seg[b] == s)
            a[b][sel] = 1.0 / (sel.sum() * len(seqs))
    dh_dz = -p * (z - (p * z).sum(-1, keepdims=True))
    expected = np.zeros_like(z)
    expected[:, :-1] = (-0.05 * a[:, 1:])[..., None] * dh_dz[:, :-1]
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-4, atol=1e-7)


def test_entropy_coef_must_not_be_negative():
    with pytest.raises(ValueError, match="entropy_coef"):
        LossConfig(entropy_coef=-0.1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "config",
    [
        LossConfig(objective="ppo"),
        LossConfig(objective="decoupled", sampler_weight_cap=1e30),
        LossConfig(objective="gspo", clip_low=3e-4, clip_high=4e-4, aggregation="sequence_mean"),
        LossConfig(objective="ppo", tis_cap=2.0, kl_coef=0.1, kl_estimator="k3"),
        LossConfig(objective="decoupled", sequence_correction="seq_tis", sequence_cap=2.0),
    ],
)
def test_loss_and_gradient_stay_finite_for_any_log_ratio(config, dtype):
    """A sampled token whose learner/sampler (or proximal, or reference) log-ratio is ±100 or ±1e4, far past
    float32's exp overflow at ~88: the loss and its gradient stay finite, in float32 and with bfloat16 log-probs; a
    positive-advantage token whose ratio is past the clip band gets gradient 0 there, as the clipped objective's
    true gradient is; and ordinary tokens of the same batch keep the gradient they have without the outlier."""
    rng = np.random.default_rng(5)
    ex = _example(rng, with_prox=True, with_ref=True)
    mask = np.asarray(ex.loss_mask.array)
    adv = np.abs(np.asarray(ex.advantages.array)) + 0.1  # every advantage positive
    ex = dataclasses.replace(ex, advantages=hax.named(adv, (B, P)))
    lp0 = -rng.random((2, 8)).astype(np.float32) - 0.5
    entropy = hax.named(np.zeros((2, 8), np.float32), (B, P))
    first = tuple(np.argwhere(mask)[0])

    def loss_and_grad(example):
        def f(x):
            return policy_loss(hax.named(x.astype(dtype), (B, P)), entropy, example, config)[0]

        loss, grad = jax.value_and_grad(f)(jnp.asarray(lp0))
        return float(loss), np.asarray(grad, np.float32)

    _, benign_grad = loss_and_grad(ex)
    others = mask.copy()
    others[first] = False
    per_token = config.objective != "gspo" and config.sequence_correction == "none"
    for shift in (100.0, -100.0, 1e4, -1e4):
        fields = {}
        for name in ("sampler_logprobs", "proximal_logprobs", "reference_logprobs"):
            arr = np.array(getattr(ex, name).array)
            arr[first] = lp0[first] - shift  # log-ratio logp - that = shift at one sampled token
            fields[name] = hax.named(arr, (B, P))
        loss, grad = loss_and_grad(dataclasses.replace(ex, **fields))
        assert np.isfinite(loss) and np.isfinite(grad).all(), (shift, loss, grad)
        if shift > 0 and config.objective == "ppo" and config.tis_cap is None and config.kl_coef == 0:
            assert grad[first] == 0.0  # A > 0 and r = e^shift far above 1 + clip_high: the clipped branch
        if per_token:  # token-level terms: the outlier changes no other token's gradient
            np.testing.assert_array_equal(grad[others], benign_grad[others])
