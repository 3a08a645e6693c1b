"""Advantage estimators: pure functions from a group's rewards to one advantage per rollout.

Stateless estimators (`rloo`, `grpo`, `dr_grpo`) see only the group's rewards; `turn_rloo` sees each episode's
per-turn rewards and gives one advantage per turn. REINFORCE compares each reward with a
running baseline; the baseline update is itself a pure function (`ema_baseline`) and the caller keeps the state
(`GroupAdvantages` does, one per replay buffer).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from marin_rl.replay.gae import token_rewards
from marin_rl.types import Rollout


def rloo(rewards: np.ndarray) -> np.ndarray:
    """REINFORCE leave-one-out: A_i = r_i - mean_{j≠i} r_j  (0 for a group of one)."""
    r = np.asarray(rewards, dtype=np.float64)
    n = r.shape[0]
    if n < 2:
        return np.zeros_like(r)
    return r - (r.sum() - r) / (n - 1)


def grpo(rewards: np.ndarray, eps: float = 1e-6, normalize_std: bool = True) -> np.ndarray:
    """GRPO: (r_i - mean r) / (std r + eps), or only r_i - mean r when `normalize_std` is false."""
    r = np.asarray(rewards, dtype=np.float64)
    centred = r - r.mean()
    return centred / (r.std() + eps) if normalize_std else centred


def dr_grpo(rewards: np.ndarray) -> np.ndarray:
    """Dr.GRPO: r_i - mean r (no std normalisation)."""
    r = np.asarray(rewards, dtype=np.float64)
    return r - r.mean()


def remax(rewards: np.ndarray, greedy_reward: float) -> np.ndarray:
    """ReMax (Li et al. 2023): A_i = r_i − r_greedy, the baseline being the reward of the greedy completion of the
    same prompt."""
    return np.asarray(rewards, dtype=np.float64) - float(greedy_reward)


def reinforce(rewards: np.ndarray, baseline: float) -> np.ndarray:
    """Plain REINFORCE with a baseline: A_i = r_i - b, where b does not depend on this group."""
    return np.asarray(rewards, dtype=np.float64) - float(baseline)


def ema_baseline(baseline: float, rewards: np.ndarray, decay: float) -> float:
    """Running baseline after seeing a group: decay·b + (1 − decay)·mean(r)."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"baseline decay must be in [0, 1), got {decay}")
    return float(decay * baseline + (1.0 - decay) * np.mean(np.asarray(rewards, dtype=np.float64)))


def turn_rloo(step_rewards: list[np.ndarray], lam: float = 1.0) -> list[np.ndarray]:
    """Per-turn advantages of a group's episodes with a leave-one-out group value per turn (no critic).

    `step_rewards[i][k]` is episode i's reward for its k-th policy turn. The value of episode i at turn k is the mean,
    over the group's other episodes that reached turn k, of their return from turn k (G_j,k = Σ_{m≥k} r_j,m; 0 when
    no other episode got that far; 0 after the last turn). Advantages follow GAE's recursion over turns with γ = 1:

        δ_i,k = r_i,k + V_i,k+1 − V_i,k,        A_i,k = δ_i,k + λ·A_i,k+1

    λ = 1 gives A_i,k = G_i,k − V_i,k: each turn is credited with its own and later rewards against what the others
    got from the same turn on (unbiased: the baseline does not depend on episode i). λ = 0 with equal-length
    episodes gives A_i,k = r_i,k − mean_{j≠i} r_j,k: each turn's reward against the others' reward for that turn
    (no later turn's reward reaches it; exact when a turn's actions do not change later turns' rewards). A
    single-turn group gets RLOO's advantages for either λ; a group of one gets zeros."""
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lambda must be in [0, 1], got {lam}")
    rewards = [np.asarray(r, dtype=np.float64).reshape(-1) for r in step_rewards]
    n = len(rewards)
    if n < 2:
        return [np.zeros_like(r) for r in rewards]
    turns = max((len(r) for r in rewards), default=0)
    returns = np.zeros((n, turns + 1))  # G_i,k; 0 past an episode's last turn
    reached = np.zeros((n, turns + 1), bool)
    for i, r in enumerate(rewards):
        returns[i, : len(r)] = np.cumsum(r[::-1])[::-1]
        reached[i, : len(r)] = True
    total, count = (returns * reached).sum(0), reached.sum(0)
    out = []
    for i, r in enumerate(rewards):
        others = count - reached[i]
        values = np.where(others > 0, (total - returns[i] * reached[i]) / np.maximum(others, 1), 0.0)
        values[len(r) :] = 0.0
        adv = np.zeros(len(r))
        following = 0.0
        for k in range(len(r) - 1, -1, -1):
            following = r[k] + values[k + 1] - values[k] + lam * following
            adv[k] = following
        out.append(adv)
    return out


def policy_turns(rollout: Rollout) -> tuple[np.ndarray, np.ndarray]:
    """The policy turns of `rollout` as GAE sees them: maximal runs of sampled tokens (a turn boundary is where
    tokens that were not sampled come between two sampled ones). Returns (turn index of each token, -1 off the
    sampled tokens; the reward of each turn: `token_rewards` summed over the turn's tokens)."""
    mask = rollout.loss_mask()
    starts = mask & ~np.r_[False, mask[:-1]]
    turn_of = np.where(mask, np.cumsum(starts) - 1, -1)
    credited = token_rewards(rollout, per_turn=True)
    rewards = np.zeros(int(starts.sum()))
    np.add.at(rewards, turn_of[mask], credited[mask])
    return turn_of, rewards


def turn_rloo_token_advantages(rollouts: list[Rollout], lam: float = 1.0) -> list[np.ndarray]:
    """`turn_rloo` for a group of rollouts, spread onto tokens: each sampled token gets its turn's advantage (0 off
    the sampled tokens), aligned with the rollout's `token_ids`."""
    turns = [policy_turns(r) for r in rollouts]
    per_turn = turn_rloo([rewards for _, rewards in turns], lam)
    return [
        np.where(turn_of >= 0, adv[np.maximum(turn_of, 0)] if adv.size else 0.0, 0.0)
        for (turn_of, _), adv in zip(turns, per_turn, strict=True)
    ]


ESTIMATORS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"rloo": rloo, "grpo": grpo, "dr_grpo": dr_grpo}
"""Stateless estimators by name."""

ESTIMATOR_NAMES = (*ESTIMATORS, "reinforce", "remax", "gae", "turn_rloo")
"""Every name `GroupAdvantages` accepts ('remax': the group carries its greedy episode's reward; 'gae': zero group
advantages, a critic computes per-token ones; 'turn_rloo': per-turn advantages from the rollouts themselves,
`turn_rloo_token_advantages`)."""


class GroupAdvantages:
    """Applies the configured estimator group by group, keeping REINFORCE's running baseline."""

    def __init__(
        self,
        name: str,
        *,
        grpo_normalize_std: bool = True,
        grpo_eps: float = 1e-6,
        baseline_decay: float = 0.9,
        baseline_init: float = 0.0,
    ):
        if name not in ESTIMATOR_NAMES:
            raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ESTIMATOR_NAMES)}")
        if not 0.0 <= baseline_decay < 1.0:
            raise ValueError(f"baseline decay must be in [0, 1), got {baseline_decay}")
        if not math.isfinite(baseline_init):
            raise ValueError(f"baseline init must be finite, got {baseline_init}")
        self.name = name
        self.grpo_normalize_std = grpo_normalize_std
        self.grpo_eps = grpo_eps
        self.baseline_decay = baseline_decay
        self.baseline = float(baseline_init)

    def __call__(self, rewards: np.ndarray, baseline_reward: float | None = None) -> np.ndarray:
        """One advantage per reward of the group (REINFORCE then updates its baseline with the group).
        `baseline_reward`: ReMax's greedy reward (required for 'remax', unused otherwise)."""
        if self.name == "remax":
            if baseline_reward is None:
                raise ValueError("the 'remax' estimator needs the group's greedy baseline reward")
            return remax(rewards, baseline_reward)
        if self.name == "gae":
            return np.zeros(len(rewards))
        if self.name == "turn_rloo":
            raise ValueError("'turn_rloo' advantages are per turn: use turn_rloo_token_advantages on the rollouts")
        if self.name == "grpo":
            return grpo(rewards, self.grpo_eps, self.grpo_normalize_std)
        if self.name == "reinforce":
            adv = reinforce(rewards, self.baseline)
            self.baseline = ema_baseline(self.baseline, rewards, self.baseline_decay)
            return adv
        return ESTIMATORS[self.name](rewards)
