"""Advantage estimators: pure functions from a group's rewards to one advantage per rollout."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def rloo(rewards: np.ndarray) -> np.ndarray:
    """REINFORCE leave-one-out: A_i = r_i - mean_{j≠i} r_j  (0 for a group of one)."""
    r = np.asarray(rewards, dtype=np.float64)
    n = r.shape[0]
    if n < 2:
        return np.zeros_like(r)
    return r - (r.sum() - r) / (n - 1)


def grpo(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO: (r_i - mean r) / (std r + eps)."""
    r = np.asarray(rewards, dtype=np.float64)
    return (r - r.mean()) / (r.std() + eps)


def dr_grpo(rewards: np.ndarray) -> np.ndarray:
    """Dr.GRPO: r_i - mean r (no std normalisation)."""
    r = np.asarray(rewards, dtype=np.float64)
    return r - r.mean()


ESTIMATORS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"rloo": rloo, "grpo": grpo, "dr_grpo": dr_grpo}


def get_estimator(name: str) -> Callable[[np.ndarray], np.ndarray]:
    """The estimator registered under `name`."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ESTIMATORS)}")
    return ESTIMATORS[name]
