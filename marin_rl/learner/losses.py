"""Policy-gradient losses: pure functions of per-token logprobs and the batch.

Notation (per token t, only where `loss_mask` is true):
  logp        learner's logprob under the weights being trained
  logp_prox   proximal policy's logprob (the weights before this optimizer step)
  logp_behav  sampler's logprob (what the inference server reported)
  A           advantage of the rollout the token belongs to

Clipped objective: r = exp(logp - logp_old), J = min(r·A, clip(r, 1-ε_low, 1+ε_high)·A).
* objective='ppo':       logp_old = logp_behav.
* objective='decoupled': logp_old = logp_prox and J is weighted by w = exp(logp_prox - logp_behav) (AReaL's decoupled
  PPO); tokens with w > `behaviour_weight_cap` are masked out. When the batch carries no proximal logprobs, the
  weights being trained *are* the proximal policy, so logp_prox = stop_gradient(logp) and the ratio is exactly 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import haliax as hax
import jax
import jax.numpy as jnp

from marin_rl.types import RlExample

AGGREGATIONS = ("token_mean", "sequence_mean", "fixed_budget")
OBJECTIVES = ("decoupled", "ppo")


@dataclass
class LossConfig:
    """The clipped policy-gradient objective."""

    objective: str = "decoupled"
    """'decoupled' (ratio to the proximal policy, times a capped behaviour weight) or 'ppo' (ratio to the sampler)."""
    clip_low: float = 0.2
    """ε_low: the ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.28
    """ε_high: the ratio is clipped above at 1 + clip_high (clip-higher when larger than clip_low)."""
    behaviour_weight_cap: float = 5.0
    """Decoupled objective: tokens whose weight exp(logp_prox - logp_behav) exceeds this are masked."""
    aggregation: str = "token_mean"
    """'token_mean' over all trained tokens of the batch, 'sequence_mean' of per-rollout token means, or
    'fixed_budget' (Dr.GRPO: token sum divided by `num_sequences × max_response_tokens`)."""
    max_response_tokens: int = 128
    """Normaliser per rollout for aggregation='fixed_budget'."""

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"loss.objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"loss.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError("loss.clip_low and loss.clip_high must be >= 0")


def clipped_objective(
    logp: jnp.ndarray, logp_old: jnp.ndarray, advantages: jnp.ndarray, clip_low: float, clip_high: float
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Per-token min(r·A, clip(r)·A) and the ratio r = exp(logp - logp_old)."""
    ratio = jnp.exp(logp - logp_old)
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return jnp.minimum(ratio * advantages, clipped * advantages), ratio


def aggregate(
    per_token: jnp.ndarray, mask: jnp.ndarray, segment_ids: jnp.ndarray, kind: str, max_response_tokens: int
) -> jnp.ndarray:
    """Reduce per-token values over `(rows, positions)` with the named aggregation."""
    mask = mask.astype(per_token.dtype)
    if kind == "token_mean":
        return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    rows, seq = per_token.shape
    # A global id per (row, segment); padding (segment -1) is masked anyway.
    gid = (jnp.arange(rows)[:, None] * seq + jnp.maximum(segment_ids, 0)).reshape(-1)
    seg_sum = jax.ops.segment_sum((per_token * mask).reshape(-1), gid, num_segments=rows * seq)
    seg_count = jax.ops.segment_sum(mask.reshape(-1), gid, num_segments=rows * seq)
    has_tokens = seg_count > 0
    num_seqs = jnp.maximum(jnp.sum(has_tokens), 1)
    if kind == "sequence_mean":
        return jnp.sum(jnp.where(has_tokens, seg_sum / jnp.maximum(seg_count, 1.0), 0.0)) / num_seqs
    if kind == "fixed_budget":
        return jnp.sum(seg_sum) / (num_seqs * max_response_tokens)
    raise ValueError(f"unknown aggregation {kind!r}")


def policy_loss(
    logp: hax.NamedArray, entropy: hax.NamedArray, batch: RlExample, config: LossConfig
) -> tuple[jnp.ndarray, dict[str, jnp.ndarray]]:
    """The loss to minimise (-J aggregated) and per-batch metrics."""
    lp = logp.array
    mask = batch.loss_mask.array
    adv = batch.advantages.array
    behav = batch.policy_logprobs.array
    if config.objective == "ppo":
        old = behav
        weight = jnp.ones_like(lp)
        kept = mask
    else:
        prox = batch.proximal_logprobs.array if batch.proximal_logprobs is not None else jax.lax.stop_gradient(lp)
        old = prox
        weight = jnp.exp(prox - behav)
        kept = mask & (weight <= config.behaviour_weight_cap)
        weight = jnp.where(kept, weight, 0.0)
    objective, ratio = clipped_objective(lp, old, adv, config.clip_low, config.clip_high)
    per_token = -weight * objective
    loss = aggregate(per_token, kept, batch.segment_ids.array, config.aggregation, config.max_response_tokens)

    fmask = mask.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(fmask), 1.0)

    def mean(x):
        return jnp.sum(x * fmask) / n

    log_ratio_behav = lp - behav
    metrics = {
        "loss": loss,
        "ratio/mean": mean(ratio),
        "ratio/max": jnp.max(jnp.where(mask, ratio, -jnp.inf)),
        "ratio/min": jnp.min(jnp.where(mask, ratio, jnp.inf)),
        "clip_frac/low": mean(((ratio < 1.0 - config.clip_low) & (adv < 0)).astype(jnp.float32)),
        "clip_frac/high": mean(((ratio > 1.0 + config.clip_high) & (adv > 0)).astype(jnp.float32)),
        # k3 estimator of KL(behaviour || learner) on sampled tokens, x = logp_learner - logp_behav
        # E[exp(-x) - 1 + x]
        "kl_behaviour": mean(jnp.exp(-log_ratio_behav) - 1.0 + log_ratio_behav),
        "logprob_diff_behaviour/max_abs": jnp.max(jnp.where(mask, jnp.abs(log_ratio_behav), 0.0)),
        "entropy": mean(entropy.array),
        "masked_frac": 1.0 - jnp.sum(kept.astype(jnp.float32)) / n,
        "trained_tokens": jnp.sum(fmask),
    }
    return loss, metrics


def sft_loss(logp: hax.NamedArray, loss_mask: hax.NamedArray) -> jnp.ndarray:
    """Mean negative log-likelihood of the masked tokens (supervised warm start)."""
    m = loss_mask.array.astype(jnp.float32)
    return -jnp.sum(logp.array * m) / jnp.maximum(jnp.sum(m), 1.0)
