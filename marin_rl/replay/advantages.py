"""Advantage estimators: one registry of functions with one signature, `estimate(group, state) -> GroupScores`.

The math is in pure functions of a group's rewards (`rloo`, `grpo`, `dr_grpo`, `remax`, `reinforce` with
`ema_baseline`) or of its episodes' per-turn rewards (`turn_rloo`, `turn_rloo_token_advantages`). The estimators a
replay buffer can use (`replay.advantage_estimator`) are registered by name with `register_estimator`:

    @register_estimator("my_estimator")            # in the user's own module
    def my_estimator(group: RolloutGroup, state: EstimatorState) -> GroupScores:
        return GroupScores(group.rewards - group.rewards.max())

Each gets the group and its state (the estimator's options, `state.options`, plus whatever it keeps from group to
group) and returns `GroupScores`: one advantage per rollout, optionally one per token, or a rejection reason when it
cannot score the group (ReMax without the greedy reward: `no_greedy_baseline`). A stateful estimator registers a
subclass of `EstimatorState` (`state=`) whose `state_dict` / `load_state_dict` put its state in the replay buffer's
checkpoint (REINFORCE's running baseline: `RunningBaseline`, key `reinforce_baseline`). `GroupAdvantages` binds an
estimator to its state; a replay buffer holds one. A name 'package.module:NAME' imports the module first (which
registers NAME).

Built in: 'rloo', 'grpo', 'dr_grpo', 'reinforce', 'remax' (the group carries its greedy episode's reward),
'turn_rloo' (per-turn advantages spread onto tokens, `turn_lambda`) and 'gae' (zero group advantages; the batches
carry per-token rewards, `reward_credit`, for the learner's critic).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from marin_rl.replay.gae import token_rewards
from marin_rl.types import Rollout, RolloutGroup


def _tied(r: np.ndarray) -> bool:
    """Whether every reward of the group is the same: a group-relative baseline then equals each reward and every
    advantage is exactly 0, which floating point would leave at ~1e-17 (0.1 + 0.1 + 0.1 != 0.3), enough for dynamic
    sampling to keep a group that carries no signal."""
    return r.size > 0 and bool(np.all(r == r.flat[0]))


def rloo(rewards: np.ndarray) -> np.ndarray:
    """REINFORCE leave-one-out: A_i = r_i - mean_{j≠i} r_j  (0 for a group of one, and exactly 0 when all tie)."""
    r = np.asarray(rewards, dtype=np.float64)
    n = r.shape[0]
    if n < 2 or _tied(r):
        return np.zeros_like(r)
    return r - (r.sum() - r) / (n - 1)


def grpo(rewards: np.ndarray, eps: float = 1e-6, normalize_std: bool = True) -> np.ndarray:
    """GRPO: (r_i - mean r) / (std r + eps), or only r_i - mean r when `normalize_std` is false (exactly 0 when all
    rewards tie)."""
    r = np.asarray(rewards, dtype=np.float64)
    if _tied(r):
        return np.zeros_like(r)
    centred = r - r.mean()
    return centred / (r.std() + eps) if normalize_std else centred


def dr_grpo(rewards: np.ndarray) -> np.ndarray:
    """Dr.GRPO: r_i - mean r (no std normalisation; exactly 0 when all rewards tie)."""
    r = np.asarray(rewards, dtype=np.float64)
    return np.zeros_like(r) if _tied(r) else r - r.mean()


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
    single-turn group gets RLOO's advantages for either λ; a group of one, or of episodes whose per-turn rewards are
    all the same, gets exact zeros."""
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lambda must be in [0, 1], got {lam}")
    rewards = [np.asarray(r, dtype=np.float64).reshape(-1) for r in step_rewards]
    n = len(rewards)
    if n < 2 or (len({len(r) for r in rewards}) == 1 and _tied(np.stack(rewards))):
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


# ---- the registry -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EstimatorOptions:
    """The options an estimator reads (`state.options`); a replay buffer fills them from its `ReplayConfig`."""

    grpo_normalize_std: bool = True
    """'grpo': divide the centred rewards by the group's std."""
    grpo_eps: float = 1e-6
    """'grpo': added to the std."""
    baseline_decay: float = 0.9
    """'reinforce': decay of the running baseline (`ema_baseline`)."""
    baseline_init: float = 0.0
    """'reinforce': the baseline before the first group."""
    turn_lambda: float = 1.0
    """'turn_rloo': λ across turns."""
    reward_credit: str = "per_turn"
    """'gae': which tokens the rewards are credited to ('per_turn' or 'episode_end')."""

    def __post_init__(self):
        if not 0.0 <= self.baseline_decay < 1.0:
            raise ValueError(f"baseline decay must be in [0, 1), got {self.baseline_decay}")
        if not math.isfinite(self.baseline_init):
            raise ValueError(f"baseline init must be finite, got {self.baseline_init}")
        if not 0.0 <= self.turn_lambda <= 1.0:
            raise ValueError(f"turn lambda must be in [0, 1], got {self.turn_lambda}")


class EstimatorState:
    """What an estimator keeps from group to group, and its options. This base keeps nothing (the stateless
    estimators' state): no checkpoint keys, no metrics. A stateful estimator registers a subclass."""

    def __init__(self, options: EstimatorOptions):
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible state, stored among the replay buffer's checkpoint keys (so its keys must not clash with
        the buffer's own)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from a replay buffer's checkpoint (the whole buffer state: read your own keys; a key that is
        absent, e.g. in a checkpoint written with another estimator, leaves the current value)."""

    def metrics(self) -> dict[str, float]:
        """Figures reported under `replays/{env}/`."""
        return {}


class RunningBaseline(EstimatorState):
    """REINFORCE's running baseline (`ema_baseline` of the group mean rewards), checkpointed as
    `reinforce_baseline`."""

    def __init__(self, options: EstimatorOptions):
        super().__init__(options)
        self.baseline = float(options.baseline_init)

    def update(self, rewards: np.ndarray) -> None:
        self.baseline = ema_baseline(self.baseline, rewards, self.options.baseline_decay)

    def state_dict(self) -> dict[str, Any]:
        return {"reinforce_baseline": self.baseline}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "reinforce_baseline" in state:
            self.baseline = float(state["reinforce_baseline"])

    def metrics(self) -> dict[str, float]:
        return {"reinforce_baseline": self.baseline}


@dataclass(frozen=True)
class GroupScores:
    """What an estimator makes of a group: one advantage per rollout (and optionally one per token), or a
    rejection (`reason`, a short code counted under `replays/{env}/rejected/{reason}`, and `detail` for the log)."""

    advantages: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """One advantage per rollout, in the group's order (with per-token advantages: what the rollout's row in the
    Parquet store and `ReplayItem.advantage` report, e.g. their mean over its sampled tokens)."""
    token_advantages: list[np.ndarray] | None = None
    """Per rollout, one advantage per token (aligned with its `token_ids`; the batches train on these), or None:
    each rollout's advantage on all its sampled tokens."""
    reward_credit: str | None = None
    """'per_turn' or 'episode_end': the batches carry per-token rewards for a critic ('gae'); None: not."""
    reason: str | None = None
    """Why the group cannot be scored (None: it was)."""
    detail: str = ""
    """What was wrong, for the log."""

    def __post_init__(self):
        object.__setattr__(self, "advantages", np.asarray(self.advantages, dtype=np.float64).reshape(-1))

    @staticmethod
    def reject(reason: str, detail: str) -> GroupScores:
        """The group cannot be scored: the replay buffer rejects it with `reason`."""
        return GroupScores(reason=reason, detail=detail)

    @property
    def rejected(self) -> bool:
        return self.reason is not None


Estimate = Callable[[RolloutGroup, Any], GroupScores]
"""An estimator's one signature: `estimate(group, state) -> GroupScores` (`state`: its `EstimatorState`)."""


@dataclass(frozen=True)
class RegisteredEstimator:
    """A registry entry: the estimator function and the class of its state."""

    name: str
    """The name `replay.advantage_estimator` chooses it by."""
    estimate: Estimate
    """The function: `estimate(group, state) -> GroupScores`."""
    state: type[EstimatorState] = EstimatorState
    """The class of its per-buffer state."""
    greedy_baseline: bool = False
    """It scores a group against the reward of a greedy (temperature 0) episode of the same problem
    (`RolloutGroup.baseline_reward`): whoever samples groups for it samples that episode beside each one (ReMax)."""


ESTIMATORS: dict[str, RegisteredEstimator] = {}
"""The registry: every estimator `replay.advantage_estimator` can name (`register_estimator` adds to it)."""

ESTIMATOR_NAMES = ESTIMATORS.keys()
"""The registered names (a live view of the registry's keys)."""


def register_estimator(
    name: str, *, state: type[EstimatorState] = EstimatorState, greedy_baseline: bool = False
) -> Callable[[Estimate], Estimate]:
    """Decorator: register `estimate(group, state) -> GroupScores` as the advantage estimator `name`, with a fresh
    `state(options)` per replay buffer; `greedy_baseline`: its groups carry a greedy episode's reward
    (`RegisteredEstimator.greedy_baseline`). Returns the function unchanged. Registering another function under a taken
    name raises ValueError (registering the same one again, e.g. on a module reload, replaces it)."""
    if not name or ":" in name:
        raise ValueError(f"advantage estimator names are non-empty and have no ':', got {name!r}")

    def register(estimate: Estimate) -> Estimate:
        old = ESTIMATORS.get(name)
        where = f"{getattr(estimate, '__module__', '?')}.{getattr(estimate, '__qualname__', estimate)}"
        if old is not None:
            old_where = f"{getattr(old.estimate, '__module__', '?')}.{getattr(old.estimate, '__qualname__', old)}"
            if old_where != where:
                raise ValueError(f"advantage estimator {name!r} is already registered ({old_where})")
        ESTIMATORS[name] = RegisteredEstimator(name, estimate, state, greedy_baseline)
        return estimate

    return register


def get_estimator(name: str) -> RegisteredEstimator:
    """The registered estimator `name`; 'package.module:NAME' imports the module first (which registers NAME).
    Raises ValueError naming the registered ones."""
    registered = name
    if name not in ESTIMATORS and ":" in name:
        module, _, registered = name.partition(":")
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"advantage estimator {name!r}: cannot import {module!r}: {e}") from e
    if registered not in ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {name!r}; choose one of {sorted(ESTIMATORS)} (or 'package.module:NAME')"
        )
    return ESTIMATORS[registered]


# ---- the built-in estimators -----------------------------------------------------------------------------------


@register_estimator("rloo")
def estimate_rloo(group: RolloutGroup, state: EstimatorState) -> GroupScores:
    return GroupScores(rloo(group.rewards))


@register_estimator("grpo")
def estimate_grpo(group: RolloutGroup, state: EstimatorState) -> GroupScores:
    return GroupScores(grpo(group.rewards, state.options.grpo_eps, state.options.grpo_normalize_std))


@register_estimator("dr_grpo")
def estimate_dr_grpo(group: RolloutGroup, state: EstimatorState) -> GroupScores:
    return GroupScores(dr_grpo(group.rewards))


@register_estimator("reinforce", state=RunningBaseline)
def estimate_reinforce(group: RolloutGroup, state: RunningBaseline) -> GroupScores:
    """Rewards against the running baseline of earlier groups; then the baseline takes this group in."""
    rewards = group.rewards
    advantages = reinforce(rewards, state.baseline)
    state.update(rewards)
    return GroupScores(advantages)


@register_estimator("remax", greedy_baseline=True)
def estimate_remax(group: RolloutGroup, state: EstimatorState) -> GroupScores:
    """Rewards against the group's greedy episode's reward; a group without one is rejected."""
    if group.baseline_reward is None:
        return GroupScores.reject("no_greedy_baseline", f"group {group.group_id} carries no greedy reward")
    return GroupScores(remax(group.rewards, group.baseline_reward))


@register_estimator("turn_rloo")
def estimate_turn_rloo(group: RolloutGroup, state: EstimatorState) -> GroupScores:
    """Per-turn leave-one-out advantages on each turn's tokens; a rollout's advantage is their mean over its sampled
    tokens."""
    tokens = turn_rloo_token_advantages(group.rollouts, state.options.turn_lambda)
    means = [
        float(a[r.loss_mask()].mean()) if r.num_sampled_tokens else 0.0
        for r, a in zip(group.rollouts, tokens, strict=True)
    ]
    return GroupScores(means, token_advantages=tokens)


@register_estimator("gae")
def estimate_gae(group: RolloutGroup, state: EstimatorState) -> GroupScores:
    """No group advantage: the batches carry per-token rewards and the learner's critic estimates advantages."""
    return GroupScores(np.zeros(len(group.rewards)), reward_credit=state.options.reward_credit)


# ---- an estimator bound to its state ---------------------------------------------------------------------------


@dataclass
class _RewardsOnly:
    """A group known only by its rewards (`GroupAdvantages.__call__`)."""

    rewards: np.ndarray
    baseline_reward: float | None
    estimator: str
    group_id: str = "(rewards only)"

    @property
    def rollouts(self) -> list[Rollout]:
        raise ValueError(
            f"advantage estimator {self.estimator!r} reads the group's rollouts, not only their rewards (e.g. for "
            "advantages per turn or per token): score the RolloutGroup with GroupAdvantages.score"
        )


class GroupAdvantages:
    """A registered estimator bound to its state, as a replay buffer holds it: `score(group)` gives its
    `GroupScores`; `state_dict` / `load_state_dict` / `metrics` are its state's; the state's attributes read through
    (REINFORCE's `baseline`)."""

    def __init__(
        self,
        name: str,
        *,
        grpo_normalize_std: bool = True,
        grpo_eps: float = 1e-6,
        baseline_decay: float = 0.9,
        baseline_init: float = 0.0,
        turn_lambda: float = 1.0,
        reward_credit: str = "per_turn",
    ):
        self.estimator = get_estimator(name)
        self.name = name
        self.options = EstimatorOptions(
            grpo_normalize_std=grpo_normalize_std,
            grpo_eps=grpo_eps,
            baseline_decay=baseline_decay,
            baseline_init=baseline_init,
            turn_lambda=turn_lambda,
            reward_credit=reward_credit,
        )
        self.state = self.estimator.state(self.options)

    def score(self, group: RolloutGroup) -> GroupScores:
        """The estimator's scores of `group` (ValueError if it returns the wrong number of them)."""
        scores = self.estimator.estimate(group, self.state)
        if scores.rejected:
            return scores
        n = len(group.rewards)
        if len(scores.advantages) != n:
            raise ValueError(
                f"advantage estimator {self.name!r} gave {len(scores.advantages)} advantages for {n} rollouts"
            )
        if scores.token_advantages is not None:
            lengths = [len(a) for a in scores.token_advantages]
            if lengths != [r.num_tokens for r in group.rollouts]:
                raise ValueError(
                    f"advantage estimator {self.name!r} gave per-token advantages of lengths {lengths} for rollouts "
                    f"of {[r.num_tokens for r in group.rollouts]} tokens"
                )
        return scores

    def __call__(self, rewards: np.ndarray, baseline_reward: float | None = None) -> np.ndarray:
        """One advantage per reward of a group known only by its rewards (`baseline_reward`: ReMax's greedy
        reward). ValueError when the estimator rejects the group or needs its rollouts ('turn_rloo')."""
        scores = self.score(_RewardsOnly(np.asarray(rewards, dtype=np.float64), baseline_reward, self.name))
        if scores.rejected:
            reason = (scores.reason or "").replace("_", " ")
            raise ValueError(f"advantage estimator {self.name!r} cannot score the group: {reason} ({scores.detail})")
        return scores.advantages

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.state.load_state_dict(state)

    def metrics(self) -> dict[str, float]:
        return self.state.metrics()

    def __getattr__(self, attr: str) -> Any:
        if attr == "state" or attr.startswith("__"):  # no state yet (e.g. while unpickling), or a protocol lookup
            raise AttributeError(attr)
        return getattr(self.state, attr)
