"""Policy-gradient losses: pure functions of per-token logprobs and the batch.

Notation (per token t, only where `loss_mask` is true):
  logp          learner's logprob under the weights being trained
  logp_prox     proximal policy's logprob: the learner's logprob under the weights before this batch's first
                optimizer step (`RlExample.proximal_logprobs`). When the batch carries none, the weights being
                trained *are* the proximal policy, so logp_prox = stop_gradient(logp) and the ratio below is exactly 1.
  logp_sampler  sampler's logprob (what the inference server reported, `RlExample.sampler_logprobs`)
  logp_ref      frozen reference model's logprob (`RlExample.reference_logprobs`)
  A             advantage of the rollout the token belongs to

Clipped objective: r = exp(logp - logp_old), J = min(r·A, clip(r, 1-ε_low, 1+ε_high)·A), times a per-token weight w
(always under stop_gradient):
* objective='ppo', tis_cap=None:   logp_old = logp_sampler, w = 1.
* objective='decoupled', tis_cap=None: logp_old = logp_prox, w = exp(logp_prox - logp_sampler) (AReaL's decoupled PPO);
  tokens with w > `sampler_weight_cap` are *masked* (w = 0 and they leave the normaliser).
* tis_cap=C (either objective): truncated importance sampling for the sampler/learner mismatch (Yao et al. 2025).
  logp_old = logp_prox and w = min(exp(logp_prox - logp_sampler), C): the mismatch between the learner at the proximal
  weights and the sampler is *truncated* instead of masked, and no token is dropped. The ratio is taken to logp_prox
  for 'ppo' too: with a ratio to logp_sampler the factor exp(logp_prox - logp_sampler) would be counted twice (once in
  r, once in w). With TIS on, 'ppo' and 'decoupled' are therefore the same loss and `sampler_weight_cap` is unused.
* objective='gspo' (Zheng et al. 2025, GSPO), in its GSPO-token form: the ratio of every kept token of a sequence is
  s = exp(mean over the sequence's kept tokens of (logp - logp_old)), written sg(s)·exp(logp - sg(logp)) so that its
  value is s and its gradient s·∇logp flows through every token; J = min(s·A, clip(s)·A) per token. With
  aggregation='sequence_mean' and one advantage per rollout this is the paper's sequence-level objective exactly (its
  gradient is s·A·mean over the tokens of ∇logp); per-token advantages (e.g. 'turn_rloo') stay per token. logp_old is
  chosen as for 'ppo'. The paper clips s far tighter than token ratios (clip_low=3e-4, clip_high=4e-4).

Sequence-level corrections of the sampler/learner mismatch (a "sequence" is one rollout: one segment of a packed row,
all its sampled tokens over every turn). With ρ = exp(Σ over the sequence's sampled tokens of (logp_prox -
logp_sampler)), under stop_gradient:
* sequence_correction='seq_tis': w = min(ρ, sequence_cap) on each of its tokens (sequence-level truncated IS); no
  token is dropped.
* sequence_correction='mis' (masked IS): w = ρ, and a sequence whose ρ lies outside `sequence_band` = [low, high] is
  masked whole (its tokens leave the loss and its normaliser).
Either replaces the per-token weight above (and `sampler_weight_cap`), and logp_old = logp_prox for every objective
(as with TIS, which it excludes).
* token_mask_band=[low, high] (IcePop): on top of any of the above, a token whose exp(logp_prox - logp_sampler) lies
  outside the band is masked (it leaves the normaliser, like the decoupled masking).

KL to a frozen reference (added when kl_coef = β > 0): with x = logp_ref - logp on each sampled token, Schulman's
estimators of KL(π || π_ref) are k1 = -x, k2 = x²/2, k3 = exp(x) - 1 - x (x clamped to ±`LOG_RATIO_BOUND` in k3, as
every exponentiated log-ratio here is: the loss's value and gradient stay finite whatever the log-probs). Entropy bonus
(entropy_coef = c > 0): H_t is the policy's entropy over the vocabulary at sampled token t (at the sampling temperature,
differentiable). The loss is
  -aggregate(w·J over kept tokens) + β·aggregate(k over all sampled tokens) - c·aggregate(H over all sampled tokens).

Mismatch diagnostics (metrics, whatever the options; x = logp_prox - logp_sampler on sampled tokens, which are drawn
from the sampler): `mismatch/kl_k1` = mean(-x) and `mismatch/kl_k3` = mean(exp(x) - 1 - x), estimates of
KL(sampler || learner); per sequence ρ as above (its log clamped to ±20):
`mismatch/seq_ratio/mean`, `mismatch/seq_ratio/max` and `mismatch/chi2_seq` = mean(ρ²) - 1 over sequences;
`masked_frac` (sampled tokens masked) and `masked_seq_frac` (sequences with no kept token).

Every aggregation is a numerator (a sum over the batch's rows) divided by a denominator that depends only on masks
and segments (`LossNormalizers`); passing the normalisers of a whole minibatch to `policy_loss` on a slice of its rows
makes the per-slice losses, gradients and metrics add up to the whole minibatch's (gradient accumulation;
see `combine_metrics`).

Losses are looked up by name in a registry (`register_loss`, `get_loss`: `marin_rl.learner.loss_registry`): a loss
is any pure JAX function of (logprobs, entropy, batch) returning (loss, metrics). The built-in objectives
('decoupled', 'ppo', 'gspo') and the distillation losses are registered here through the same door, with two optional
keyword arguments that a user loss may declare too: `config` (the run's `LossConfig`, `marin_rl.learner.config`) and
`normalizers` (the whole minibatch's `LossNormalizers` when gradients are accumulated).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

from marin_rl.learner.batch import RlExample
from marin_rl.learner.config import KL_ESTIMATORS, OBJECTIVES, LossConfig
from marin_rl.learner.loss_registry import LossFn, register_loss

METRIC_LOG_RATIO_BOUND = 20.0
"""A sequence's log importance ratio is clamped to ±this for the diagnostics."""

LOG_RATIO_BOUND = 20.0
"""Every log-ratio the loss exponentiates (a token's r, GSPO's sequence s, the sampler weight's exp(logp_prox -
logp_sampler), k3's x) is clamped to ±this first. float32 overflows at exp(~88.7), and an infinite ratio gives an
infinite value or, through `minimum`'s unselected branch (0·∞), a NaN gradient even where the clipped branch's true
gradient is 0; one NaN spoils the whole update. e^20 ≈ 4.9e8 lies far beyond any clip band or cap, so only a token
whose ratio is already astronomically off changes: its gradient through r is 0 instead of ±∞ or NaN (verl clamps
at the same bound)."""


def _k3(x: jnp.ndarray) -> jnp.ndarray:
    """Schulman's k3 = exp(x) - 1 - x, with x clamped to ±`LOG_RATIO_BOUND` (finite, and so is its gradient)."""
    x = jnp.clip(x, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return jnp.exp(x) - 1.0 - x


def _safe_exp(log_ratio: jnp.ndarray) -> jnp.ndarray:
    """exp of `log_ratio` clamped to ±`LOG_RATIO_BOUND`, computed in float32 at least (a bfloat16 log-ratio too)."""
    x = log_ratio.astype(jnp.promote_types(log_ratio.dtype, jnp.float32))
    return jnp.exp(jnp.clip(x, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))


class LossNormalizers(NamedTuple):
    """Denominators of the loss terms and of the metric means; they depend on masks and segments only."""

    policy: jnp.ndarray
    """Denominator of the policy-gradient term (over kept tokens)."""
    reference: jnp.ndarray
    """Denominator of the KL-to-reference and entropy terms (over all sampled tokens)."""
    tokens: jnp.ndarray
    """Number of sampled tokens (at least 1): the denominator of the per-token metric means."""
    sequences: jnp.ndarray
    """Number of sequences with a sampled token (at least 1): the denominator of the per-sequence metric means."""


def clipped_objective(
    logp: jnp.ndarray, logp_old: jnp.ndarray, advantages: jnp.ndarray, clip_low: float, clip_high: float
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Per-token min(r·A, clip(r)·A) and the ratio r = exp(logp - logp_old) (its log clamped to ±`LOG_RATIO_BOUND`)."""
    ratio = _safe_exp(logp - logp_old)
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return jnp.minimum(ratio * advantages, clipped * advantages), ratio


def gspo_token_objective(
    logp: jnp.ndarray,
    logp_old: jnp.ndarray,
    advantages: jnp.ndarray,
    mask: jnp.ndarray,
    segment_ids: jnp.ndarray,
    clip_low: float,
    clip_high: float,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """GSPO-token: per-token min(s·A, clip(s)·A) with s = sg(exp(mean over the sequence's `mask`ed tokens of
    (logp - logp_old)))·exp(logp - sg(logp)): its value is the sequence's ratio, its gradient s·∇logp. Returns the
    per-token objective and s."""
    seq_log_ratio = sequence_means(jax.lax.stop_gradient(logp - logp_old), mask, segment_ids)
    ratio = _safe_exp(seq_log_ratio) * jnp.exp(logp - jax.lax.stop_gradient(logp))
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return jnp.minimum(ratio * advantages, clipped * advantages), ratio


def _log_or_minus_inf(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def importance_weights(
    logp_prox: jnp.ndarray,
    logp_sampler: jnp.ndarray,
    mask: jnp.ndarray,
    config: LossConfig,
    segment_ids: jnp.ndarray | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Per-token weight w (under stop_gradient) and the kept-token mask, as described in the module docstring.

    `logp_prox` is unused for objective='ppo' or 'gspo' without TIS, sequence correction or token masks (w = 1 and
    every sampled token is kept). `segment_ids` are needed by a sequence correction.
    """
    if not config.uses_proximal:
        return jnp.ones(mask.shape, jnp.float32), mask
    raw = jax.lax.stop_gradient(_safe_exp(logp_prox - logp_sampler))
    if config.sequence_correction != "none":
        if segment_ids is None:
            raise ValueError("a sequence correction needs the batch's segment_ids")
        log_rho = sequence_sums(jax.lax.stop_gradient(logp_prox - logp_sampler), mask, segment_ids)
        if config.sequence_correction == "seq_tis":
            weight, kept = _safe_exp(jnp.minimum(log_rho, math.log(config.sequence_cap))), mask
        else:
            low, high = config.sequence_band
            inside = (log_rho >= _log_or_minus_inf(low)) & (log_rho <= math.log(high))
            weight, kept = _safe_exp(jnp.where(inside, log_rho, 0.0)), mask & inside
    elif config.tis_cap is not None:
        weight, kept = jnp.minimum(raw, config.tis_cap), mask
    elif config.objective == "decoupled":
        weight, kept = raw, mask & (raw <= config.sampler_weight_cap)
    else:
        weight, kept = jnp.ones(mask.shape, jnp.float32), mask
    if config.token_mask_band is not None:
        low, high = config.token_mask_band
        kept = kept & (raw >= low) & (raw <= high)
    return jnp.where(kept, weight, 0.0), kept


def kl_estimate(logp: jnp.ndarray, logp_ref: jnp.ndarray, estimator: str) -> jnp.ndarray:
    """Per-token estimate of KL(π || π_ref) from x = logp_ref - logp: k1 = -x, k2 = x²/2, k3 = exp(x) - 1 - x."""
    x = logp_ref - logp
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        return _k3(x)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def _segment_sums(per_token: jnp.ndarray, mask: jnp.ndarray, segment_ids: jnp.ndarray):
    rows, seq = per_token.shape
    # A global id per (row, segment); padding (segment -1) is masked anyway.
    gid = (jnp.arange(rows)[:, None] * seq + jnp.maximum(segment_ids, 0)).reshape(-1)
    seg_sum = jax.ops.segment_sum((per_token * mask).reshape(-1), gid, num_segments=rows * seq)
    seg_count = jax.ops.segment_sum(mask.reshape(-1), gid, num_segments=rows * seq)
    return seg_sum, seg_count


def aggregate_numerator(per_token: jnp.ndarray, mask: jnp.ndarray, segment_ids: jnp.ndarray, kind: str) -> jnp.ndarray:
    """The part of an aggregation that adds up over rows: token sum, or sum of per-sequence token means."""
    mask = mask.astype(per_token.dtype)
    if kind in ("token_mean", "fixed_budget"):
        return jnp.sum(per_token * mask)
    if kind == "sequence_mean":
        seg_sum, seg_count = _segment_sums(per_token, mask, segment_ids)
        return jnp.sum(jnp.where(seg_count > 0, seg_sum / jnp.maximum(seg_count, 1.0), 0.0))
    raise ValueError(f"unknown aggregation {kind!r}")


def aggregate_denominator(
    mask: jnp.ndarray, segment_ids: jnp.ndarray, kind: str, max_response_tokens: int
) -> jnp.ndarray:
    """Normaliser of an aggregation: token count, sequence count, or sequence count × budget (each at least 1)."""
    fmask = mask.astype(jnp.float32)
    if kind == "token_mean":
        return jnp.maximum(jnp.sum(fmask), 1.0)
    if kind not in ("sequence_mean", "fixed_budget"):
        raise ValueError(f"unknown aggregation {kind!r}")
    _, seg_count = _segment_sums(jnp.zeros_like(fmask), fmask, segment_ids)
    num_seqs = jnp.maximum(jnp.sum(seg_count > 0).astype(jnp.float32), 1.0)
    return num_seqs * max_response_tokens if kind == "fixed_budget" else num_seqs


def aggregate(
    per_token: jnp.ndarray, mask: jnp.ndarray, segment_ids: jnp.ndarray, kind: str, max_response_tokens: int
) -> jnp.ndarray:
    """Reduce per-token values over `(rows, positions)` with the named aggregation."""
    num = aggregate_numerator(per_token, mask, segment_ids, kind)
    return num / aggregate_denominator(mask, segment_ids, kind, max_response_tokens)


def _masked(x: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    """`x` where `mask` is true, 0 elsewhere (also where `x` is NaN or infinite)."""
    return jnp.where(mask, x, jnp.zeros((), x.dtype))


def _proximal(logp: jnp.ndarray, batch: RlExample) -> jnp.ndarray:
    if batch.proximal_logprobs is not None:
        return batch.proximal_logprobs.array
    return jax.lax.stop_gradient(logp)


def loss_normalizers(batch: RlExample, config: LossConfig, logp: jnp.ndarray | None = None) -> LossNormalizers:
    """Normalisers of `policy_loss` for a whole (mini)batch.

    When the kept tokens depend on logp_prox (decoupled masking, MIS, token masks), the batch must carry
    `proximal_logprobs`, or `logp` (the current weights' logprobs) must be given.
    """
    mask = batch.loss_mask.array
    seg = batch.segment_ids.array
    if config.kept_depends_on_proximal and batch.proximal_logprobs is None and logp is None:
        raise ValueError(
            "the decoupled objective's kept tokens depend on the proximal logprobs: give the batch "
            "proximal_logprobs (or the current logprobs) to compute the normalisers"
        )
    if config.kept_depends_on_proximal:
        prox = batch.proximal_logprobs.array if batch.proximal_logprobs is not None else logp
        sampler = _masked(batch.sampler_logprobs.array, mask)
        _, kept = importance_weights(_masked(prox, mask), sampler, mask, config, seg)
    else:
        kept = mask
    kind, budget = config.aggregation, config.max_response_tokens
    return LossNormalizers(
        policy=aggregate_denominator(kept, seg, kind, budget),
        reference=aggregate_denominator(mask, seg, kind, budget),
        tokens=jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0),
        sequences=num_sequences(mask, seg),
    )


def policy_loss(
    logp: hax.NamedArray,
    entropy: hax.NamedArray,
    batch: RlExample,
    config: LossConfig,
    normalizers: LossNormalizers | None = None,
) -> tuple[jnp.ndarray, dict[str, jnp.ndarray]]:
    """The loss to minimise (-J aggregated, plus β·KL, minus c·entropy) and per-batch metrics.

    `normalizers` defaults to this batch's own; pass a minibatch's (`loss_normalizers`) when `batch` is a slice of
    its rows: the slices' losses, gradients and metrics then add up to the minibatch's (maxima and minima combine
    by max and min; see `combine_metrics`). With kl_coef > 0 the batch must carry
    `reference_logprobs`.
    """
    mask = batch.loss_mask.array
    # Every per-token input is replaced by a benign value where the loss mask is false *before* any nonlinearity, so
    # masked positions contribute exactly zero to the loss and its gradient whatever they hold (NaN, inf, a log-prob
    # far from the policy's): a `where` after exp() would still send 0·inf = NaN back through the unselected branch.
    lp = _masked(logp.array, mask)
    adv = _masked(batch.advantages.array, mask)
    sampler = _masked(batch.sampler_logprobs.array, mask)
    seg = batch.segment_ids.array
    prox = _masked(_proximal(lp, batch), mask)
    weight, kept = importance_weights(prox, sampler, mask, config, seg)
    old = prox if config.ratio_to_proximal else sampler
    if normalizers is None:
        normalizers = loss_normalizers(batch, config, prox)
    if config.objective == "gspo":
        objective, ratio = gspo_token_objective(lp, old, adv, kept, seg, config.clip_low, config.clip_high)
    else:
        objective, ratio = clipped_objective(lp, old, adv, config.clip_low, config.clip_high)
    per_token = -weight * objective
    pg_loss = aggregate_numerator(per_token, kept, seg, config.aggregation) / normalizers.policy

    fmask = mask.astype(jnp.float32)
    n = normalizers.tokens

    def mean(x):
        return jnp.sum(x * fmask) / n

    log_ratio_sampler = lp - sampler
    metrics = {
        "pg_loss": pg_loss,
        "ratio/mean": mean(ratio),
        "ratio/max": jnp.max(jnp.where(mask, ratio, -jnp.inf)),
        "ratio/min": jnp.min(jnp.where(mask, ratio, jnp.inf)),
        "clip_frac/low": mean(((ratio < 1.0 - config.clip_low) & (adv < 0)).astype(jnp.float32)),
        "clip_frac/high": mean(((ratio > 1.0 + config.clip_high) & (adv > 0)).astype(jnp.float32)),
        # k3 estimator of KL(sampler || learner) on the sampled tokens (drawn from the sampler):
        # with ρ = π_learner / π_sampler = exp(x), E_sampler[ρ - 1 - log ρ] = KL(sampler || learner).
        "kl_sampler": mean(_k3(log_ratio_sampler)),
        "logprob_diff_sampler/max_abs": jnp.max(jnp.where(mask, jnp.abs(log_ratio_sampler), 0.0)),
        "entropy": mean(_masked(entropy.array, mask)),
        "masked_frac": mean((mask & ~kept).astype(jnp.float32)),
        "trained_tokens": jnp.sum(fmask),
        **_mismatch_metrics(prox, sampler, mask, kept, seg, mean, normalizers.sequences),
    }
    if config.uses_proximal:
        metrics["importance_weight/mean"] = mean(weight)
    if config.tis_cap is not None:
        raw = jnp.exp(prox - sampler)
        metrics["tis/truncated_frac"] = mean((raw > config.tis_cap).astype(jnp.float32))
    loss = pg_loss
    if config.kl_coef > 0:
        if batch.reference_logprobs is None:
            raise ValueError("loss.kl_coef > 0 needs the batch's reference_logprobs (the frozen reference model's)")
        ref = _masked(jax.lax.stop_gradient(batch.reference_logprobs.array), mask)
        k = kl_estimate(lp, ref, config.kl_estimator)
        kl = aggregate_numerator(k, mask, seg, config.aggregation) / normalizers.reference
        metrics["kl_reference"] = kl
        loss = loss + config.kl_coef * kl
    if config.entropy_coef > 0:
        ent = _masked(entropy.array, mask)
        bonus = aggregate_numerator(ent, mask, seg, config.aggregation) / normalizers.reference
        metrics["entropy_bonus"] = bonus
        loss = loss - config.entropy_coef * bonus
    metrics["loss"] = loss
    return loss, metrics


def _mismatch_metrics(prox, sampler, mask, kept, seg, mean, num_seqs) -> dict[str, jnp.ndarray]:
    """The sampler/learner mismatch diagnostics of the module docstring (sums over this batch's rows divided by the
    whole minibatch's `mean` and `num_seqs` normalisers, so that row slices add up)."""
    x = prox - sampler  # 0 off the loss mask
    log_rho, count = _segment_sums(x, mask.astype(x.dtype), seg)
    _, kept_count = _segment_sums(jnp.zeros_like(x), kept.astype(x.dtype), seg)
    has = count > 0
    rho = jnp.exp(jnp.clip(log_rho, -METRIC_LOG_RATIO_BOUND, METRIC_LOG_RATIO_BOUND))
    return {
        "mismatch/kl_k1": mean(-x),
        "mismatch/kl_k3": mean(_k3(x)),
        "mismatch/seq_ratio/mean": jnp.sum(jnp.where(has, rho, 0.0)) / num_seqs,
        "mismatch/seq_ratio/max": jnp.max(jnp.where(has, rho, -jnp.inf)),
        "mismatch/chi2_seq": jnp.sum(jnp.where(has, rho * rho - 1.0, 0.0)) / num_seqs,
        "masked_seq_frac": jnp.sum((has & (kept_count == 0)).astype(jnp.float32)) / num_seqs,
    }


def combine_metrics(stacked: dict[str, jnp.ndarray], rest: str = "sum") -> dict[str, jnp.ndarray]:
    """Combine metrics stacked along a leading axis: those whose last name component starts with 'max'
    ('ratio/max', '.../max_abs') by max, 'min' by min, every other one by `rest`.

    'sum': the values are `policy_loss` metrics of row slices computed with the whole batch's normalisers (each a
    sum over the batch divided by a batch normaliser), so the slices' values add up. 'mean': the values are those
    of whole batches (e.g. the optimizer steps of one train step), averaged.
    """
    if rest not in ("sum", "mean"):
        raise ValueError(f"rest must be 'sum' or 'mean', got {rest!r}")
    out = {}
    for k, v in stacked.items():
        xp = np if isinstance(v, np.ndarray) else jnp  # host metrics stay on the host
        last = k.rsplit("/", 1)[-1]
        if last.startswith("max"):
            out[k] = xp.max(v, axis=0)
        elif last.startswith("min"):
            out[k] = xp.min(v, axis=0)
        else:
            out[k] = xp.sum(v, axis=0) if rest == "sum" else xp.mean(v, axis=0)
    return out


def sft_loss(logp: hax.NamedArray, loss_mask: hax.NamedArray) -> jnp.ndarray:
    """Mean negative log-likelihood of the masked tokens (supervised warm start)."""
    m = loss_mask.array.astype(jnp.float32)
    return -jnp.sum(logp.array * m) / jnp.maximum(jnp.sum(m), 1.0)


def proximal_logprobs(logprobs: hax.NamedArray, batch: RlExample) -> jnp.ndarray:
    """logp_prox for a loss: the batch's `proximal_logprobs`, or (none given: the current weights are the proximal
    policy) stop_gradient of the current logprobs. A raw `(batch, position)` array."""
    return _proximal(logprobs.array, batch)


def _per_token(per_segment: jnp.ndarray, segment_ids: jnp.ndarray) -> jnp.ndarray:
    """Each position's value of its (row, segment) in `per_segment` (as `_segment_sums` indexes them); 0 on padding."""
    rows, seq = segment_ids.shape
    gid = (jnp.arange(rows)[:, None] * seq + jnp.maximum(segment_ids, 0)).reshape(-1)
    return jnp.where(segment_ids >= 0, per_segment[gid].reshape(rows, seq), 0.0)


def sequence_means(values: jnp.ndarray, mask: jnp.ndarray, segment_ids: jnp.ndarray) -> jnp.ndarray:
    """Per-token mean of `values` over the masked tokens of the sequence (packed segment) each token belongs to:
    a `(rows, positions)` array holding, at every position, its sequence's mean (0 for a sequence with no masked
    token and on padding)."""
    seg_sum, seg_count = _segment_sums(_masked(values, mask), mask.astype(values.dtype), segment_ids)
    return _per_token(jnp.where(seg_count > 0, seg_sum / jnp.maximum(seg_count, 1.0), 0.0), segment_ids)


def sequence_sums(values: jnp.ndarray, mask: jnp.ndarray, segment_ids: jnp.ndarray) -> jnp.ndarray:
    """Per-token sum of `values` over the masked tokens of the sequence (packed segment) each token belongs to (0 on
    padding). Segments never cross rows, so a slice of rows gives its rows' sums."""
    seg_sum, _ = _segment_sums(_masked(values, mask), mask.astype(values.dtype), segment_ids)
    return _per_token(seg_sum, segment_ids)


def num_sequences(mask: jnp.ndarray, segment_ids: jnp.ndarray) -> jnp.ndarray:
    """Number of sequences (packed segments) with at least one masked token (at least 1)."""
    _, seg_count = _segment_sums(jnp.zeros(mask.shape, jnp.float32), mask.astype(jnp.float32), segment_ids)
    return jnp.maximum(jnp.sum(seg_count > 0).astype(jnp.float32), 1.0)


def _objective_loss(objective: str) -> LossFn:
    def loss(logprobs, entropy, batch, *, config: LossConfig | None = None, normalizers=None):
        if config is None:
            config = LossConfig(objective=objective)
        elif config.objective != objective:
            config = dataclasses.replace(config, objective=objective)
        return policy_loss(logprobs, entropy, batch, config, normalizers)

    loss.__name__ = f"{objective}_loss"
    loss.__doc__ = f"`policy_loss` with objective={objective!r} (the module docstring states it)."
    return loss


for _objective in OBJECTIVES:
    register_loss(_objective, uses_proximal=_objective == "decoupled")(_objective_loss(_objective))


# ---- on-policy distillation ---------------------------------------------------------------------------------------
def opd_advantages(batch: RlExample, config: LossConfig) -> jnp.ndarray:
    """Per-token advantage of on-policy distillation (0 off the loss mask):
    A_t = -opd_coef·(logp_sampler_t - logp_teacher_t - b) + opd_task_coef·A_task_t, the teacher's logprob of each
    token the student sampled (`RlExample.teacher_logprobs`) against the sampler's, plus the task's group advantage;
    b is 0, or with `opd_baseline` the mean of logp_sampler - logp_teacher over the sampled tokens."""
    if batch.teacher_logprobs is None:
        raise ValueError(
            "on-policy distillation needs the batch's teacher_logprobs: run learner.algorithm: opd with a teacher"
        )
    mask = batch.loss_mask.array
    gap = _masked(batch.sampler_logprobs.array, mask) - _masked(batch.teacher_logprobs.array, mask)
    if config.opd_baseline:
        fmask = mask.astype(gap.dtype)
        gap = gap - jnp.sum(gap * fmask) / jnp.maximum(jnp.sum(fmask), 1.0)
    task = _masked(batch.advantages.array, mask)
    return jnp.where(mask, -config.opd_coef * gap + config.opd_task_coef * task, 0.0)


@register_loss("opd_reverse_kl")
def opd_reverse_kl(
    logprobs: hax.NamedArray,
    entropy: hax.NamedArray,
    batch: RlExample,
    *,
    config: LossConfig | None = None,
    normalizers: LossNormalizers | None = None,
) -> tuple[jnp.ndarray, dict[str, jnp.ndarray]]:
    """On-policy distillation by reverse KL (Thinking Machines, "On-Policy Distillation", 2025): the clipped objective
    (objective 'ppo': ratio to the sampler; `tis_cap`, KL and entropy terms as configured) with the per-token
    advantages of `opd_advantages` in place of the batch's. Its mean over sampled tokens is a policy gradient of
    -KL(π_student || π_teacher) on the student's own samples (plus the task reward's when `opd_task_coef` > 0).

    Metrics beside `policy_loss`'s: 'opd/reverse_kl' (mean of logp_sampler - logp_teacher over sampled tokens, the
    per-token estimate of KL(student || teacher)), 'opd/teacher_logprob' (mean teacher logprob of the sampled tokens)
    and 'opd/advantage' (mean combined advantage)."""
    config = config if config is not None else LossConfig(objective="opd_reverse_kl")
    inner = dataclasses.replace(config, objective="ppo")
    advantages = opd_advantages(batch, config)
    distilled = dataclasses.replace(batch, advantages=hax.named(advantages, batch.advantages.axes))
    if normalizers is None:
        normalizers = loss_normalizers(distilled, inner)
    loss, metrics = policy_loss(logprobs, entropy, distilled, inner, normalizers)
    mask = batch.loss_mask.array
    fmask = mask.astype(jnp.float32)
    gap = _masked(batch.sampler_logprobs.array, mask) - _masked(batch.teacher_logprobs.array, mask)
    metrics["opd/reverse_kl"] = jnp.sum(gap * fmask) / normalizers.tokens
    metrics["opd/teacher_logprob"] = jnp.sum(_masked(batch.teacher_logprobs.array, mask) * fmask) / normalizers.tokens
    metrics["opd/advantage"] = jnp.sum(advantages * fmask) / normalizers.tokens
    return loss, metrics


def forward_kl_topk(
    student_top_logprobs: jnp.ndarray, teacher_top_logprobs: jnp.ndarray, mask: jnp.ndarray
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Per position, KL(q_T || π_student) over the teacher's top-k tokens, with q_T the teacher's top-k renormalised
    to sum to 1 (zero outside them): Σ_i q_i·(log q_i - log π_student(i)), `student_top_logprobs` being the student's
    full-vocabulary logprobs of those k tokens (arrays `(rows, positions, k)`). Returns it (0 off `mask`) and the
    teacher's top-k mass Σ_i p_T(i) (what the renormalisation divides by). Its gradient in the student's logits at
    a position is π_student - q_T (q_T zero off the top-k): the teacher is a constant (stop_gradient)."""
    teacher = jax.lax.stop_gradient(jnp.where(mask[..., None], teacher_top_logprobs, 0.0))
    student = jnp.where(mask[..., None], student_top_logprobs, 0.0)
    log_mass = jax.nn.logsumexp(teacher, axis=-1, keepdims=True)
    log_q = teacher - log_mass
    kl = jnp.sum(jnp.exp(log_q) * (log_q - student), axis=-1)
    return jnp.where(mask, kl, 0.0), jnp.where(mask, jnp.exp(log_mass[..., 0]), 0.0)


@register_loss("opd_forward_kl_topk")
def opd_forward_kl_topk(
    logprobs: hax.NamedArray,
    entropy: hax.NamedArray,
    batch: RlExample,
    *,
    config: LossConfig | None = None,
    normalizers: LossNormalizers | None = None,
    student_top_logprobs: hax.NamedArray | None = None,
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """On-policy distillation by top-k forward KL (as GKD, Agarwal et al. 2024, and slime's top-k distillation): at
    every token the student sampled, KL(q_T || π_student) over the teacher's top-k tokens at that position
    (`forward_kl_topk`: the teacher's top-k renormalised to sum to 1, the student's full-vocabulary logprobs at
    learner temperature), aggregated over the sampled tokens like the reference KL (`learner.loss.aggregation`)
    and weighted by `opd_coef`; plus the clipped policy gradient (objective 'ppo') of the task's advantage times
    `opd_task_coef` (0: a zero gradient; its KL and entropy terms as configured). Gradients reach the student only.

    Metrics beside `policy_loss`'s: 'opd/forward_kl_topk' (the aggregated KL), 'opd/teacher_topk_mass' (mean
    teacher probability of its top-k, before renormalising), 'opd/student_topk_mass' (the student's probability of
    the teacher's top-k), 'opd/reverse_kl' and 'opd/teacher_logprob' as in 'opd_reverse_kl'."""
    config = config if config is not None else LossConfig(objective="opd_forward_kl_topk", opd_task_coef=0.0)
    if batch.teacher_top_logprobs is None or batch.teacher_logprobs is None or student_top_logprobs is None:
        raise ValueError(
            "top-k distillation needs the teacher's top-k in the batch and the student's logprobs there: run "
            "learner.algorithm: opd with teacher.top_k > 0"
        )
    inner = dataclasses.replace(config, objective="ppo")
    mask = batch.loss_mask.array
    seg = batch.segment_ids.array
    task = jnp.where(mask, config.opd_task_coef * _masked(batch.advantages.array, mask), 0.0)
    tasked = dataclasses.replace(batch, advantages=hax.named(task, batch.advantages.axes))
    if normalizers is None:
        normalizers = loss_normalizers(tasked, inner)
    pg, metrics = policy_loss(logprobs, entropy, tasked, inner, normalizers)
    student = student_top_logprobs.rearrange(batch.teacher_top_logprobs.axes).array
    kl, mass = forward_kl_topk(student, batch.teacher_top_logprobs.array, mask)
    distill = aggregate_numerator(kl, mask, seg, config.aggregation) / normalizers.reference
    loss = pg + config.opd_coef * distill
    fmask = mask.astype(jnp.float32)
    student_mass = jnp.sum(jnp.exp(jnp.where(mask[..., None], student, -jnp.inf)), axis=-1)
    gap = _masked(batch.sampler_logprobs.array, mask) - _masked(batch.teacher_logprobs.array, mask)
    metrics["opd/forward_kl_topk"] = distill
    metrics["opd/teacher_topk_mass"] = jnp.sum(mass * fmask) / normalizers.tokens
    metrics["opd/student_topk_mass"] = jnp.sum(jax.lax.stop_gradient(student_mass) * fmask) / normalizers.tokens
    metrics["opd/reverse_kl"] = jnp.sum(gap * fmask) / normalizers.tokens
    metrics["opd/teacher_logprob"] = jnp.sum(_masked(batch.teacher_logprobs.array, mask) * fmask) / normalizers.tokens
    metrics["loss"] = loss
    return loss, metrics


def value_loss(
    values: jnp.ndarray, old_values: jnp.ndarray, returns: jnp.ndarray, mask: jnp.ndarray, clip: float | None
) -> tuple[jnp.ndarray, dict[str, jnp.ndarray]]:
    """PPO's value loss over `(rows, positions)` arrays, a token mean over `mask`: ½·max((V − R)², (V_old +
    clip(V − V_old, ±clip) − R)²), or ½·(V − R)² when `clip` is None. Returns (loss, metrics)."""
    fmask = mask.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(fmask), 1.0)
    v = jnp.where(mask, values, 0.0)
    old = jnp.where(mask, old_values, 0.0)
    ret = jnp.where(mask, returns, 0.0)
    unclipped = (v - ret) ** 2
    if clip is None:
        per_token, clipped_frac = unclipped, jnp.zeros(())
    else:
        clipped = (old + jnp.clip(v - old, -clip, clip) - ret) ** 2
        per_token = jnp.maximum(unclipped, clipped)
        clipped_frac = jnp.sum(fmask * (clipped > unclipped)) / n
    loss = 0.5 * jnp.sum(per_token * fmask) / n
    return loss, {"value_loss": loss, "value_clip_frac": clipped_frac, "value_mean": jnp.sum(v * fmask) / n}
