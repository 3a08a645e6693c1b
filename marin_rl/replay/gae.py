"""Generalized advantage estimation (GAE, Schulman et al. 2016) per token, for multi-turn episodes and packed rows.

Positions are aligned like the learner's logprobs: the value at position t is about token t. `values[t]` is the
critic's V(state before token t was sampled); `rewards[t]` is the reward credited to sampled token t
(`token_rewards`). Over an episode's sampled tokens s_0 < s_1 < … < s_{n-1} (environment and prompt tokens are
skipped: they get no advantage and do not break the recursion, so a tool's answer between two assistant turns
neither ends the episode nor is acted on):

    δ_k = r_k + γ·V_{k+1} − V_k,        V_n = the bootstrap value (truncated episode) or 0 (ended episode)
    A_k = δ_k + γλ·A_{k+1},             A_n = 0
    R_k = A_k + V_k                     (the critic's return target)

An episode cut off by a length limit did not end: its last step bootstraps from V(state after its last token),
which the critic computes at the episode's last position. γ = λ = 1 with V = 0 gives every token the sum of the
rewards after it (REINFORCE with per-token credit).

A turn boundary is where tokens that were not sampled (the environment's reply, a chat template's header) come
between two sampled tokens of an episode. `lam_between_turns` replaces λ in the recursion across such a boundary:
with λ = 1 inside turns and 0 between them, each token of a turn gets the rewards left in its turn plus γ·V(start of
the next turn) − V_k, that is GAE over turns as steps (turn-level TD(0)), and no later turn's reward reaches it.
"""

from __future__ import annotations

import numpy as np

from marin_rl.types import Rollout


def token_rewards(rollout: Rollout, per_turn: bool = True) -> np.ndarray:
    """The reward credited to each token of `rollout` (0 off its sampled tokens), aligned with `rollout.token_ids`.

    `per_turn`: each turn's reward goes to the last sampled token at or before the end of that turn (the action that
    earned it; rewards of turns before the first sampled token go to the first one). Otherwise the episode's total
    reward goes to its last sampled token (reward only at the episode's end). A rollout without sampled tokens gets
    zeros."""
    mask = rollout.loss_mask()
    out = np.zeros(len(mask), np.float64)
    sampled = np.flatnonzero(mask)
    if sampled.size == 0:
        return out
    if not per_turn:
        out[sampled[-1]] = rollout.reward
        return out
    end = 0
    for turn in rollout.turns:
        end += len(turn.token_ids)
        before = sampled[sampled < end]
        out[before[-1] if before.size else sampled[0]] += turn.reward
    return out


def gae_packed(
    rewards: np.ndarray,
    values: np.ndarray,
    mask: np.ndarray,
    segment_ids: np.ndarray,
    gamma: float,
    lam: float,
    bootstrap: np.ndarray | None = None,
    lam_between_turns: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Advantages and returns for packed `(rows, positions)` arrays, each segment (one episode; -1 is padding) on
    its own. `mask`: the sampled tokens. `bootstrap`: the value V_n of each truncated episode, read at its segment's
    last position (0 there, or None, for episodes that ended). `lam_between_turns`: λ across a turn boundary (see
    the module's docstring; None: `lam`). Returns float64 arrays, 0 off the mask. Raises ValueError for a reward
    off the mask, γ or a λ outside [0, 1], or mismatched shapes."""
    rewards, values = np.asarray(rewards, np.float64), np.asarray(values, np.float64)
    mask, segment_ids = np.asarray(mask, bool), np.asarray(segment_ids)
    if rewards.ndim != 2 or not rewards.shape == values.shape == mask.shape == segment_ids.shape:
        raise ValueError(
            f"rewards, values, mask and segment_ids must be (rows, positions) arrays of one shape, got "
            f"{rewards.shape}, {values.shape}, {mask.shape}, {segment_ids.shape}"
        )
    lam_between = lam if lam_between_turns is None else lam_between_turns
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0 and 0.0 <= lam_between <= 1.0):
        raise ValueError(f"gamma and lambda must be in [0, 1], got {gamma}, {lam} (between turns: {lam_between})")
    if np.any(rewards[~mask] != 0):
        raise ValueError("rewards must be credited to sampled tokens (nonzero reward off the mask); see token_rewards")
    boot = np.zeros_like(values) if bootstrap is None else np.asarray(bootstrap, np.float64)
    if boot.shape != values.shape:
        raise ValueError(f"bootstrap must have the shape {values.shape}, got {boot.shape}")
    rows, positions = rewards.shape
    advantages, returns = np.zeros_like(rewards), np.zeros_like(rewards)
    next_value, next_adv = np.zeros(rows), np.zeros(rows)
    gap = np.zeros(rows, bool)  # a token that was not sampled lies between t and the next sampled token
    for t in range(positions - 1, -1, -1):
        seg = segment_ids[:, t]
        last = (seg != segment_ids[:, t + 1]) if t + 1 < positions else np.ones(rows, bool)
        next_value = np.where(last, boot[:, t], next_value)  # a new episode (read backwards) starts here
        next_adv = np.where(last, 0.0, next_adv)
        gap = gap & ~last
        m = mask[:, t] & (seg >= 0)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * np.where(gap, lam_between, lam) * next_adv
        advantages[:, t] = np.where(m, adv, 0.0)
        returns[:, t] = np.where(m, adv + values[:, t], 0.0)
        next_value = np.where(m, values[:, t], next_value)
        next_adv = np.where(m, adv, next_adv)
        gap = np.where(m, False, gap | (seg >= 0))
    return advantages, returns


def gae(
    rewards: np.ndarray,
    values: np.ndarray,
    mask: np.ndarray,
    gamma: float,
    lam: float,
    bootstrap_value: float = 0.0,
    lam_between_turns: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """`gae_packed` for one episode: 1-D arrays over its tokens; `bootstrap_value` is V_n (0 for an ended episode)."""
    rewards, values, mask = (np.asarray(x)[None] for x in (rewards, values, mask))
    boot = np.zeros(values.shape)
    if boot.size:
        boot[0, -1] = bootstrap_value
    segments = np.zeros(mask.shape, np.int32)
    adv, ret = gae_packed(rewards, values, mask, segments, gamma, lam, boot, lam_between_turns)
    return adv[0], ret[0]


def whiten(advantages: np.ndarray, mask: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """Advantages shifted and scaled to mean 0 and standard deviation 1 over the masked tokens (0 elsewhere)."""
    a, m = np.asarray(advantages, np.float64), np.asarray(mask, bool)
    if not m.any():
        return np.zeros_like(a)
    mean, std = a[m].mean(), a[m].std()
    return np.where(m, (a - mean) / (std + eps), 0.0)
