"""GAE on the device: the recursion of `marin_rl.replay.gae.gae_packed` (its NumPy reference, which documents the
math) as a jitted reverse `lax.scan` over positions, with segment resets for packed rows.

PPO's train step computes the critic's values, these advantages and returns, and the whitened advantages on the
devices where the batch already is, so the batch crosses host → device once per step and only scalar metrics come
back. Rows are independent (the scan runs over positions, all rows at once), so a batch sharded by rows stays
sharded; whitening's mean and standard deviation are over the whole batch's sampled tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gae_packed_device(
    rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    segment_ids: jax.Array,
    gamma: float,
    lam: float,
    bootstrap: jax.Array | None = None,
    lam_between_turns: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Advantages and returns of packed `(rows, positions)` arrays, exactly `gae_packed`'s recursion (float32).

    `mask`: the sampled tokens; `segment_ids`: one episode per segment, -1 on padding; `bootstrap`: V_n of each
    truncated episode, read at its segment's last position (0 there, or None, for episodes that ended);
    `lam_between_turns`: λ across a turn boundary (None: `lam`). Returns (advantages, returns), 0 off the mask.
    Traceable (call it inside jit); γ and λ are Python floats checked by the caller's config."""
    lam_between = lam if lam_between_turns is None else lam_between_turns
    rewards = rewards.astype(jnp.float32)
    values = values.astype(jnp.float32)
    mask = mask.astype(bool)
    boot = jnp.zeros_like(values) if bootstrap is None else bootstrap.astype(jnp.float32)
    # Position t's episode ends where the next position holds another segment (or at the row's end).
    next_segment = jnp.concatenate([segment_ids[:, 1:], jnp.full_like(segment_ids[:, :1], -2)], axis=1)
    last = segment_ids != next_segment
    sampled = mask & (segment_ids >= 0)
    real = segment_ids >= 0

    def step(carry, xs):
        next_value, next_adv, gap = carry
        last_t, boot_t, m, real_t, r, v = xs
        next_value = jnp.where(last_t, boot_t, next_value)  # a new episode (read backwards) starts here
        next_adv = jnp.where(last_t, 0.0, next_adv)
        gap = gap & ~last_t
        delta = r + gamma * next_value - v
        adv = delta + gamma * jnp.where(gap, lam_between, lam) * next_adv
        out = (jnp.where(m, adv, 0.0), jnp.where(m, adv + v, 0.0))
        next_value = jnp.where(m, v, next_value)
        next_adv = jnp.where(m, adv, next_adv)
        gap = jnp.where(m, False, gap | real_t)
        return (next_value, next_adv, gap), out

    rows = rewards.shape[0]
    init = (jnp.zeros(rows, jnp.float32), jnp.zeros(rows, jnp.float32), jnp.zeros(rows, bool))
    xs = tuple(x.T for x in (last, boot, sampled, real, rewards, values))  # time-major for the scan
    _, (advantages, returns) = jax.lax.scan(step, init, xs, reverse=True)
    return advantages.T, returns.T


def whiten_device(advantages: jax.Array, mask: jax.Array, eps: float = 1e-8) -> jax.Array:
    """`marin_rl.replay.gae.whiten` on the device: mean 0 and standard deviation 1 over the masked tokens, 0
    elsewhere (all 0 when nothing is masked)."""
    m = mask.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)
    mean = jnp.sum(advantages * m) / n
    std = jnp.sqrt(jnp.sum(jnp.square(advantages - mean) * m) / n)
    return jnp.where(mask, (advantages - mean) / (std + eps), 0.0)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of `x` over `mask` (0 when the mask is empty)."""
    m = mask.astype(jnp.float32)
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def masked_variance(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Population variance of `x` over `mask` (0 when the mask is empty)."""
    return masked_mean(jnp.square(x - masked_mean(x, mask)), mask)
