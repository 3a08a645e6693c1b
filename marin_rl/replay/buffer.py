"""Per-environment replay buffer: validates groups, computes advantages, drops stale rollouts, reports metrics."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from marin_rl.replay.advantages import get_estimator
from marin_rl.types import Rollout, RolloutFormatError, RolloutGroup

logger = logging.getLogger(__name__)


@dataclass
class ReplayConfig:
    """Replay buffers (one per environment)."""

    min_group_size: int = 2
    """Groups with fewer rollouts are rejected (advantages need company)."""
    max_age: int = 4
    """A rollout whose oldest sampled token is more than this many learner steps old is discarded."""
    capacity: int = 65536
    """Most rollouts held per buffer; past it the oldest are evicted first."""
    max_reuse: int = 1
    """How many batches a rollout may appear in."""
    advantage_estimator: str = "rloo"
    """'rloo', 'grpo' or 'dr_grpo' (see marin_rl.replay.advantages)."""
    drop_zero_variance_groups: bool = False
    """Reject groups whose rewards are all equal (they carry no learning signal under group baselines)."""

    def __post_init__(self):
        get_estimator(self.advantage_estimator)  # fail early on a typo
        if self.min_group_size < 1 or self.max_age < 0 or self.capacity < 1 or self.max_reuse < 1:
            raise ValueError("replay: min_group_size, capacity, max_reuse must be >= 1 and max_age >= 0")


@dataclass
class ReplayItem:
    """A rollout waiting in the buffer, with its advantage."""

    rollout: Rollout
    advantage: float
    group_id: str
    added_at: float
    num_tokens: int
    oldest_version: int
    uses: int = 0


class ReplayBuffer:
    """Holds one environment's scored rollouts until the batcher takes them."""

    def __init__(self, env_name: str, config: ReplayConfig, vocab_size: int | None = None):
        self.env_name = env_name
        self.config = config
        self.vocab_size = vocab_size
        self.estimator = get_estimator(config.advantage_estimator)
        self.items: list[ReplayItem] = []  # oldest first
        self.rejected: Counter[str] = Counter()
        self.discarded_stale = 0
        self.evicted = 0
        self._new_rollouts = 0
        self._new_tokens = 0
        self._new_generated = 0
        self._new_rewards: list[float] = []
        self._new_truncated = 0
        self._new_named: dict[str, list[float]] = {}

    # ---- intake -------------------------------------------------------------------------------------
    def add(self, group: RolloutGroup | dict) -> bool:
        """Validate and score a group; returns whether it was accepted (rejections are logged and counted)."""
        try:
            if isinstance(group, dict):
                group = RolloutGroup.from_dict(group)
            if group.environment != self.env_name:
                raise RolloutFormatError(f"group of env {group.environment!r} sent to buffer {self.env_name!r}")
            for r in group.rollouts:
                r.validate(self.vocab_size)
        except RolloutFormatError as e:
            return self._reject("invalid", str(e))
        if len(group.rollouts) < self.config.min_group_size:
            return self._reject("group_too_small", f"{len(group.rollouts)} < {self.config.min_group_size}")
        rewards = group.rewards
        if self.config.drop_zero_variance_groups and np.all(rewards == rewards[0]):
            return self._reject("zero_variance", f"all rewards {rewards[0]}")
        advantages = self.estimator(rewards)
        now = time.time()
        for r, a in zip(group.rollouts, advantages, strict=True):
            self.items.append(
                ReplayItem(
                    rollout=r,
                    advantage=float(a),
                    group_id=group.group_id,
                    added_at=now,
                    num_tokens=r.num_tokens,
                    oldest_version=r.oldest_version,
                )
            )
            self._new_rollouts += 1
            self._new_tokens += r.num_tokens
            self._new_generated += r.num_sampled_tokens
            self._new_rewards.append(r.reward)
            self._new_truncated += int(r.truncated)
            for turn in r.turns:
                for name, value in turn.rewards.items():
                    self._new_named.setdefault(name, []).append(value)
        overflow = len(self.items) - self.config.capacity
        if overflow > 0:
            del self.items[:overflow]
            self.evicted += overflow
        return True

    def _reject(self, reason: str, detail: str) -> bool:
        self.rejected[reason] += 1
        logger.warning("replay[%s]: rejected a group (%s): %s", self.env_name, reason, detail)
        return False

    # ---- staleness and selection ----------------------------------------------------------------------
    def drop_stale(self, learner_version: int) -> int:
        """Discard rollouts older than `max_age` learner steps; returns how many were dropped."""
        limit = learner_version - self.config.max_age
        keep = [it for it in self.items if it.oldest_version >= limit]
        dropped = len(self.items) - len(keep)
        self.items = keep
        self.discarded_stale += dropped
        return dropped

    def newest_first(self) -> list[ReplayItem]:
        return list(reversed(self.items))

    def consume(self, used: list[ReplayItem]) -> None:
        """Count a use of each item; items that reached `max_reuse` leave the buffer."""
        for it in used:
            it.uses += 1
        self.items = [it for it in self.items if it.uses < self.config.max_reuse]

    def discard(self, items: list[ReplayItem]) -> None:
        """Remove items without using them."""
        ids = {id(it) for it in items}
        self.items = [it for it in self.items if id(it) not in ids]

    @property
    def num_tokens(self) -> int:
        return sum(it.num_tokens for it in self.items)

    def __len__(self) -> int:
        return len(self.items)

    # ---- metrics ----------------------------------------------------------------------------------------
    def metrics(self, learner_version: int) -> dict[str, float]:
        """`replays/{env}/...` metrics; the `new_*` and reward figures cover groups added since the last call."""
        p = f"replays/{self.env_name}"
        on_policy = sum(1 for it in self.items if it.oldest_version >= learner_version)
        out = {
            f"{p}/rollouts_in_buffer": len(self.items),
            f"{p}/tokens_in_buffer": self.num_tokens,
            f"{p}/frac_on_policy": on_policy / len(self.items) if self.items else 0.0,
            f"{p}/new_rollouts": self._new_rollouts,
            f"{p}/new_tokens": self._new_tokens,
            f"{p}/new_generated_tokens": self._new_generated,
            f"{p}/discarded_stale": self.discarded_stale,
            f"{p}/evicted": self.evicted,
        }
        for reason, n in self.rejected.items():
            out[f"{p}/rejected/{reason}"] = n
        if self._new_rewards:
            r = np.asarray(self._new_rewards)
            out[f"{p}/reward/mean"] = float(r.mean())
            out[f"{p}/reward/std"] = float(r.std())
            out[f"{p}/frac_truncated"] = self._new_truncated / len(r)
            for name, vals in self._new_named.items():
                out[f"{p}/rewards/{name}/mean"] = float(np.mean(vals))
                out[f"{p}/rewards/{name}/std"] = float(np.std(vals))
        self._new_rollouts = self._new_tokens = self._new_generated = self._new_truncated = 0
        self._new_rewards = []
        self._new_named = {}
        return out
