"""A user-written loss registered without touching the package: a sequence-level clipped objective (GSPO-style).

    python experiments/custom_loss.py [STEPS]      # the loop of experiments/custom_loop.py with this loss

Per rollout i with sampled tokens T_i: s_i = exp(mean_{t in T_i} (logp_t - logp_sampler_t)) is the sequence's
importance ratio (the geometric mean of its token ratios), and the loss is the negative mean over rollouts of
min(s_i · A_i, clip(s_i, 1 - EPS_LOW, 1 + EPS_HIGH) · A_i). Clipping acts on whole sequences: a rollout is kept or
clipped as a unit, never token by token.
"""

from __future__ import annotations

import os
import sys

import jax.numpy as jnp

from marin_rl.api import aggregate, register_loss, sequence_means

EPS_LOW = 0.1
"""Lower clip range of the sequence ratio."""
EPS_HIGH = 0.1
"""Upper clip range of the sequence ratio."""


@register_loss("sequence_clip")
def sequence_clip(logprobs, entropy, batch):
    """-mean over sequences of min(s·A, clip(s)·A), s the sequence's geometric-mean importance ratio."""
    mask, segments = batch.loss_mask.array, batch.segment_ids.array
    log_ratio = jnp.where(mask, logprobs.array - batch.sampler_logprobs.array, 0.0)
    ratio = jnp.exp(sequence_means(log_ratio, mask, segments))  # s_i at every token of sequence i
    adv = batch.advantages.array
    objective = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * adv)
    loss = -aggregate(objective, mask, segments, "sequence_mean", 0)
    clipped = jnp.where(mask, (ratio < 1 - EPS_LOW) | (ratio > 1 + EPS_HIGH), False)
    return loss, {"clip_frac": aggregate(clipped.astype(jnp.float32), mask, segments, "sequence_mean", 0)}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from custom_loop import main

    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200, "sequence_clip")
