"""Advantage estimators: pure functions from a group's rewards to one advantage per rollout.

Stateless estimators (`rloo`, `grpo`, `dr_grpo`) see only the group. REINFORCE compares each reward with a
running baseline; the baseline update is itself a pure function (`ema_baseline`) and the caller keeps the state
(`GroupAdvantages` does, one per replay buffer).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np


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


ESTIMATORS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"rloo": rloo, "grpo": grpo, "dr_grpo": dr_grpo}
"""Stateless estimators by name."""

ESTIMATOR_NAMES = (*ESTIMATORS, "reinforce", "remax", "gae")
"""Every name `GroupAdvantages` accepts ('remax': the group carries its greedy episode's reward; 'gae': zero group
advantages, a critic computes per-token ones)."""


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
        if self.name == "grpo":
            return grpo(rewards, self.grpo_eps, self.grpo_normalize_std)
        if self.name == "reinforce":
            adv = reinforce(rewards, self.baseline)
            self.baseline = ema_baseline(self.baseline, rewards, self.baseline_decay)
            return adv
        return ESTIMATORS[self.name](rewards)
