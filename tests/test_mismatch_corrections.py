"""Sequence-level sampler/learner corrections (seq-TIS, MIS), IcePop token masks, GSPO and the mismatch metrics,
against NumPy references written from the formulas (not from the code), on packed rows of several multi-turn
rollouts."""

import dataclasses

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl.learner.batch import RlExample
from marin_rl.learner.config import LossConfig
from marin_rl.learner.losses import combine_metrics, loss_normalizers, policy_loss

ROWS, POS = 3, 26
B, P = hax.Axis("batch", ROWS), hax.Axis("position", POS)


def _packed_example(seed: int, with_prox: bool = True, token_advantages: bool = False):
    """Rows of 2-3 packed rollouts and padding. Each rollout: a 2-token prompt, a sampled turn, 2 tool tokens (not
    sampled), a second sampled turn: the loss mask has two spans per rollout. Advantages are one per rollout (or,
    with `token_advantages`, one per turn)."""
    rng = np.random.default_rng(seed)
    seg = np.full((ROWS, POS), -1, np.int32)
    mask = np.zeros((ROWS, POS), bool)
    adv = np.zeros((ROWS, POS), np.float32)
    for r, lengths in enumerate([(9, 8, 7), (12, 10), (8, 9, 8)]):
        start = 0
        for s, n in enumerate(lengths):
            seg[r, start : start + n] = s
            turn1 = rng.integers(2, n - 4)  # sampled tokens [2, 2 + turn1), tools next 2, then sampled to the end
            mask[r, start + 2 : start + 2 + turn1] = True
            mask[r, start + 4 + turn1 : start + n] = True
            a = rng.normal()
            adv[r, start : start + n] = a
            if token_advantages:
                adv[r, start + 4 + turn1 : start + n] = a + rng.normal()
            start += n
    sampler = -rng.random((ROWS, POS)).astype(np.float32) * 3
    prox = (sampler + 0.15 * rng.normal(size=(ROWS, POS))).astype(np.float32)

    def named(x):
        return hax.named(x, (B, P))

    return RlExample(
        input_ids=named(np.zeros((ROWS, POS), np.int32)),
        position_ids=named(np.zeros((ROWS, POS), np.int32)),
        segment_ids=named(seg),
        loss_mask=named(mask),
        advantages=named(np.where(mask, adv, 0).astype(np.float32)),
        sampler_logprobs=named(np.where(mask, sampler, 0).astype(np.float32)),
        token_versions=named(np.zeros((ROWS, POS), np.int32)),
        proximal_logprobs=named(np.where(mask, prox, 0).astype(np.float32)) if with_prox else None,
    )


def _arrays(ex):
    f64 = {k: np.asarray(getattr(ex, k).array, np.float64) for k in ("advantages", "sampler_logprobs")}
    prox = None if ex.proximal_logprobs is None else np.asarray(ex.proximal_logprobs.array, np.float64)
    return (
        np.asarray(ex.loss_mask.array),
        np.asarray(ex.segment_ids.array),
        f64["advantages"],
        f64["sampler_logprobs"],
        prox,
    )


def _sequences(seg, mask):
    """(row, positions of the rollout's sampled tokens) of every rollout with a sampled token."""
    out = []
    for b in range(seg.shape[0]):
        for s in np.unique(seg[b][seg[b] >= 0]):
            sel = (seg[b] == s) & mask[b]
            if sel.any():
                out.append((b, sel))
    return out


def _weights_and_kept(cfg: LossConfig, prox, sampler, mask, seg):
    """w and the kept tokens, from the module docstring's definitions."""
    raw = np.exp(prox - sampler)
    kept = mask.copy()
    if cfg.sequence_correction != "none":
        w = np.zeros_like(prox)
        for b, sel in _sequences(seg, mask):
            rho = np.exp(np.sum(prox[b][sel] - sampler[b][sel]))
            if cfg.sequence_correction == "seq_tis":
                w[b][sel] = min(rho, cfg.sequence_cap)
            elif cfg.sequence_band[0] <= rho <= cfg.sequence_band[1]:
                w[b][sel] = rho
            else:
                kept[b][sel] = False
    elif cfg.objective == "decoupled":
        w = raw
        kept &= raw <= cfg.sampler_weight_cap
    else:
        w = np.ones_like(prox)
    if cfg.token_mask_band is not None:
        kept &= (raw >= cfg.token_mask_band[0]) & (raw <= cfg.token_mask_band[1])
    return np.where(kept, w, 0.0), kept


def _aggregate(x, kept, seg, kind, budget):
    seqs = _sequences(seg, kept)
    if kind == "token_mean":
        return (x * kept).sum() / kept.sum()
    if kind == "sequence_mean":
        return np.mean([x[b][sel].mean() for b, sel in seqs])
    return sum(x[b][sel].sum() for b, sel in seqs) / (len(seqs) * budget)


def _reference_loss(cfg: LossConfig, lp, ex):
    """The loss from the formulas, in float64; logp_prox is the batch's (held fixed when `lp` varies)."""
    mask, seg, adv, sampler, prox = _arrays(ex)
    if prox is None:
        prox = lp
    w, kept = _weights_and_kept(cfg, prox, sampler, mask, seg)
    ratio_to_prox = cfg.objective == "decoupled" or cfg.sequence_correction != "none" or cfg.tis_cap is not None
    old = prox if ratio_to_prox else sampler
    if cfg.objective == "gspo":
        ratio = np.zeros_like(lp)
        for b, sel in _sequences(seg, kept):
            ratio[b][sel] = np.exp(np.mean(lp[b][sel] - old[b][sel]))
    else:
        ratio = np.exp(lp - old)
    obj = np.minimum(ratio * adv, np.clip(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * adv)
    return _aggregate(-w * obj, kept, seg, cfg.aggregation, cfg.max_response_tokens)


def _finite_difference(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[idx] += eps
        down[idx] -= eps
        g[idx] = (f(up) - f(down)) / (2 * eps)
    return g


def _loss_and_grad(cfg, lp, ex, normalizers=None):
    def f(x):
        return policy_loss(
            hax.named(x, ex.loss_mask.axes), hax.named(jnp.zeros(x.shape), ex.loss_mask.axes), ex, cfg, normalizers
        )

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp, jnp.float32))
    return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad, np.float64)


CONFIGS = {
    "seq_tis": LossConfig(objective="ppo", sequence_correction="seq_tis", sequence_cap=1.1),
    "mis": LossConfig(
        objective="decoupled", sequence_correction="mis", sequence_band=(0.8, 1.2), aggregation="sequence_mean"
    ),
    "icepop_ppo": LossConfig(objective="ppo", token_mask_band=(0.9, 1.1)),
    "mis_icepop_budget": LossConfig(
        objective="ppo",
        sequence_correction="mis",
        sequence_band=(0.7, 1.5),
        token_mask_band=(0.85, 1.2),
        aggregation="fixed_budget",
        max_response_tokens=12,
    ),
    "gspo": LossConfig(objective="gspo", clip_low=0.02, clip_high=0.03, aggregation="sequence_mean"),
    "gspo_seq_tis_icepop": LossConfig(
        objective="gspo",
        clip_low=0.02,
        clip_high=0.03,
        sequence_correction="seq_tis",
        sequence_cap=1.2,
        token_mask_band=(0.85, 1.2),
    ),
}


def _learner_logprobs(ex, seed, scale=0.1):
    rng = np.random.default_rng(seed)
    base = np.asarray(ex.proximal_logprobs.array, np.float64)
    return np.where(np.asarray(ex.loss_mask.array), base + scale * rng.normal(size=base.shape), 0.0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_gradient_match_the_formula(name):
    """Value, and gradient by central finite differences of the NumPy loss (the weights and kept tokens depend on
    logp_prox and logp_sampler only, so they stay fixed when logp moves); gradients are 0 off the kept tokens."""
    cfg = CONFIGS[name]
    ex = _packed_example(1)
    lp = _learner_logprobs(ex, 2, scale=0.02 if cfg.objective == "gspo" else 0.1)
    loss, _, grad = _loss_and_grad(cfg, lp, ex)
    np.testing.assert_allclose(loss, _reference_loss(cfg, lp, ex), rtol=1e-5, atol=1e-7)
    expected = _finite_difference(lambda x: _reference_loss(cfg, x, ex), lp)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6)
    assert np.abs(grad).max() > 1e-3


def test_the_example_exercises_every_branch():
    """The bands and caps above split the rollouts and tokens of the example: some truncated / masked, some not, and
    GSPO ratios both inside and outside their clip range."""
    ex = _packed_example(1)
    mask, seg, _, sampler, prox = _arrays(ex)
    rho = np.array([np.exp(np.sum(prox[b][sel] - sampler[b][sel])) for b, sel in _sequences(seg, mask)])
    assert (rho > 1.2).any() and (rho < 0.8).any() and ((rho >= 0.8) & (rho <= 1.2)).any()
    assert (rho > 1.1).any() and (rho < 1.1).any()
    raw = np.exp(prox - sampler)[mask]
    assert (raw > 1.1).any() and (raw < 0.9).any() and ((raw >= 0.9) & (raw <= 1.1)).any()
    lp = _learner_logprobs(ex, 2, scale=0.02)
    s = np.array([np.exp(np.mean(lp[b][sel] - sampler[b][sel])) for b, sel in _sequences(seg, mask)])
    assert ((s > 1.03) | (s < 0.98)).any() and ((s <= 1.03) & (s >= 0.98)).any()


def test_gspo_token_gradient_with_per_turn_advantages():
    """GSPO-token with an advantage per turn: d(loss)/d(logp_t) = -a_t · A_t · s_i where the token's clipped
    objective is not the constant branch (a_t: the aggregation's weight of token t), else 0."""
    cfg = LossConfig(objective="gspo", clip_low=0.02, clip_high=0.03, aggregation="token_mean")
    ex = _packed_example(3, token_advantages=True)
    mask, seg, adv, sampler, _ = _arrays(ex)
    lp = _learner_logprobs(ex, 4, scale=0.02)
    loss, metrics, grad = _loss_and_grad(cfg, lp, ex)
    s = np.zeros_like(lp)
    for b, sel in _sequences(seg, mask):
        s[b][sel] = np.exp(np.mean(lp[b][sel] - sampler[b][sel]))
    clipped = ((adv > 0) & (s > 1.03)) | ((adv < 0) & (s < 0.98))
    assert clipped[mask].any() and (~clipped[mask]).any()
    expected = np.where(mask & ~clipped, -adv * s / mask.sum(), 0.0)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)
    obj = np.minimum(s * adv, np.clip(s, 0.98, 1.03) * adv)
    np.testing.assert_allclose(loss, -(obj * mask).sum() / mask.sum(), rtol=1e-5)
    np.testing.assert_allclose(metrics["ratio/max"], s[mask].max(), rtol=1e-5)


@pytest.mark.parametrize("correction", ["seq_tis", "mis"])
def test_first_step_without_proximal_logprobs_weighs_by_the_learner(correction):
    """In a batch's first step logp_prox = stop_gradient(logp): ρ compares the learner's own logprobs with the
    sampler's, the ratio is 1, and d(loss)/d(logp_t) = -w_t·A_t / (kept tokens)."""
    cfg = LossConfig(objective="ppo", sequence_correction=correction, sequence_cap=1.1, sequence_band=(0.8, 1.2))
    with_prox = _packed_example(5)
    lp = np.asarray(with_prox.proximal_logprobs.array, np.float64)
    ex = dataclasses.replace(with_prox, proximal_logprobs=None)
    mask, seg, adv, sampler, _ = _arrays(ex)
    loss, metrics, grad = _loss_and_grad(cfg, lp, ex)
    w, kept = _weights_and_kept(cfg, lp, sampler, mask, seg)
    np.testing.assert_allclose(loss, -(w * adv * kept).sum() / kept.sum(), rtol=1e-5)
    np.testing.assert_allclose(grad, np.where(kept, -w * adv / kept.sum(), 0.0), rtol=1e-5, atol=1e-7)
    assert metrics["ratio/mean"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("name", ["mis_icepop_budget", "gspo_seq_tis_icepop", "seq_tis"])
def test_mismatch_metrics_match_the_formulas(name):
    cfg = CONFIGS[name]
    ex = _packed_example(6)
    mask, seg, _, sampler, prox = _arrays(ex)
    _, metrics, _ = _loss_and_grad(cfg, _learner_logprobs(ex, 7), ex)
    x = (prox - sampler)[mask]
    seqs = _sequences(seg, mask)
    rho = np.array([np.exp(np.sum(prox[b][sel] - sampler[b][sel])) for b, sel in seqs])
    _, kept = _weights_and_kept(cfg, prox, sampler, mask, seg)
    expected = {
        "mismatch/kl_k1": np.mean(-x),
        "mismatch/kl_k3": np.mean(np.exp(x) - 1 - x),
        "mismatch/seq_ratio/mean": rho.mean(),
        "mismatch/seq_ratio/max": rho.max(),
        "mismatch/chi2_seq": np.mean(rho**2) - 1,
        "masked_frac": 1 - kept.sum() / mask.sum(),
        "masked_seq_frac": np.mean([not kept[b][sel].any() for b, sel in seqs]),
    }
    for key, value in expected.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    if cfg.sequence_correction == "mis":
        assert 0 < metrics["masked_seq_frac"] < 1
    assert metrics["mismatch/kl_k3"] > 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_row_slices_with_batch_normalizers_add_up_to_the_batch(name):
    """Gradient accumulation over row slices: each slice's loss, gradient and metrics, normalised by the whole
    batch, add up (maxima by max) to the whole batch's."""
    cfg = CONFIGS[name]
    ex = _packed_example(8)
    lp = _learner_logprobs(ex, 9, scale=0.02 if cfg.objective == "gspo" else 0.1)
    loss, metrics, grad = _loss_and_grad(cfg, lp, ex)
    norm = loss_normalizers(ex, cfg)
    one = hax.Axis("batch", 1)
    parts = []
    for b in range(ROWS):
        row = RlExample(
            **{k: None if v is None else hax.named(v.array[b : b + 1], (one, P)) for k, v in ex.__dict__.items()}
        )
        parts.append(_loss_and_grad(cfg, lp[b : b + 1], row, norm))
    np.testing.assert_allclose(sum(p[0] for p in parts), loss, rtol=1e-5)
    np.testing.assert_allclose(np.concatenate([p[2] for p in parts]), grad, rtol=1e-5, atol=1e-8)
    combined = combine_metrics({k: np.asarray([p[1][k] for p in parts]) for k in metrics})
    for k in metrics:
        np.testing.assert_allclose(combined[k], metrics[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_default_configs_add_only_metrics():
    """With none of the options set, no token is masked by them and no sequence weight applies: the loss is the
    plain decoupled / PPO one (the NumPy reference of tests/test_losses.py's formulas)."""
    ex = _packed_example(10)
    lp = _learner_logprobs(ex, 11)
    for cfg in (LossConfig(), LossConfig(objective="ppo")):
        loss, metrics, _ = _loss_and_grad(cfg, lp, ex)
        np.testing.assert_allclose(loss, _reference_loss(cfg, lp, ex), rtol=1e-5)
        assert metrics["masked_seq_frac"] == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sequence_correction": "seq_mis"}, "sequence_correction must be one of"),
        ({"sequence_correction": "seq_tis", "tis_cap": 2.0}, "set one of them"),
        ({"sequence_band": (1.2, 2.0)}, "sequence_band"),
        ({"sequence_band": (0.5, 0.9)}, "sequence_band"),
        ({"token_mask_band": (0.5, float("nan"))}, "token_mask_band"),
        ({"token_mask_band": (2.0, 1.0)}, "token_mask_band"),
        ({"token_mask_band": (0.5,)}, "token_mask_band"),
        ({"token_mask_band": (-0.1, 2.0)}, "token_mask_band"),
        ({"sequence_cap": 0.0}, "sequence_cap"),
        ({"objective": "marin_rl.learner.losses:sft_loss", "token_mask_band": (0.5, 2.0)}, "built-in objectives"),
    ],
)
def test_nonsensical_settings_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        LossConfig(**kwargs)
    assert "\n" not in str(e.value)
