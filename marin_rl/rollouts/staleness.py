"""The staleness gate: how many new groups may start, so that generation runs at most η versions ahead of training.

AReaL's rule, stated on outstanding data. Let v be the policy version the servers serve, b the batches formed so
far (the one training included), B the rollouts a batch takes, η = `orchestrator.max_staleness`. A new group of g
rollouts may start only while

    in_flight + buffered + g  <=  (v + η + 1 − b) · B,

that is while the rollouts in flight or waiting in the buffer, the new ones included, fill at most v + η + 1 − b
batches. Rollouts dropped on the way (stale, rejected) free their room. If the batcher waits for this environment
and none of its groups is in flight, one group may start regardless (`starved`), so that a misestimated B cannot
stall the run. The decision depends only on these numbers: asking again without a change starts nothing more.

What this guarantees (tests/test_staleness.py checks each):

1. Invariant: after every decision, in_flight + buffered <= max(0, v + η + 1 − b) · B, plus at most one group
   started under the starvation rule.
2. Bound under first-in-first-out consumption: a group started while v is served is among the outstanding data
   that batches b .. v + η take; if each batch takes B rollouts oldest first, it is trained by learner version
   v + η at the latest, so every one of its tokens (sampled by version >= v) lags at most η versions.
3. The batcher takes the newest rollouts first (the freshest data trains first), which gives up (2) for leftovers:
   a rollout that waits while newer ones are taken can lag more than η. `replay.max_age` is therefore the hard
   bound: the batcher drops every rollout whose oldest token lags more than `max_age` versions before forming a
   batch, so every trained token lags at most `max_age` (>= η) versions. The gate keeps such drops rare: the
   buffer holds at most about η + 1 batches of data.

B is not known in advance (rollouts differ in length, batches in tokens): `RolloutsPerBatch` estimates it from the
token budget until batches exist, then follows what batches took (exponential average).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GateInputs:
    """What the gate decides from (one environment)."""

    served_version: int
    """v: the policy version the servers serve."""
    batches_formed: int
    """b: batches formed so far, the one the learner trains on now included."""
    in_flight: int
    """Rollouts of groups started and not yet in the buffer."""
    buffered: int
    """Rollouts waiting in the buffer."""
    rollouts_per_batch: float
    """B: rollouts of this environment a batch takes."""
    starved: bool = False
    """The batcher waits for this environment's data."""


class StalenessGate:
    """Pure decision: how many groups of `group_size` rollouts may start (module docstring)."""

    def __init__(self, max_staleness: int, group_size: int):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.max_staleness = int(max_staleness)
        self.group_size = int(group_size)

    def capacity(self, served_version: int, batches_formed: int, rollouts_per_batch: float) -> float:
        """Rollouts that may be outstanding: (v + η + 1 − b) · B (0 when negative)."""
        batches = served_version + self.max_staleness + 1 - batches_formed
        return max(0, batches) * max(1.0, rollouts_per_batch)

    def groups_allowed(self, state: GateInputs) -> int:
        """How many new groups may start now."""
        room = self.capacity(state.served_version, state.batches_formed, state.rollouts_per_batch)
        room -= state.in_flight + state.buffered
        allowed = max(0, math.floor(room / self.group_size + 1e-9))
        if allowed == 0 and state.starved and state.in_flight == 0:
            return 1
        return allowed


class RolloutsPerBatch:
    """Estimate of B, the rollouts of one environment a batch takes: its token share over the mean rollout length
    until batches exist, then an exponential average of what batches took."""

    def __init__(self, tokens_per_batch: float, initial_rollout_tokens: float):
        self.tokens_per_batch = float(tokens_per_batch)
        self.mean_rollout_tokens = float(initial_rollout_tokens)
        self.measured: float | None = None

    @property
    def value(self) -> float:
        """The current estimate (at least 1)."""
        if self.measured is not None:
            return max(1.0, self.measured)
        return max(1.0, self.tokens_per_batch / self.mean_rollout_tokens)

    def observe_rollout_tokens(self, tokens: list[int]) -> None:
        """Refine the mean rollout length from a group's rollouts."""
        if tokens:
            self.mean_rollout_tokens = 0.9 * self.mean_rollout_tokens + 0.1 * (sum(tokens) / len(tokens))

    def set_share(self, tokens_per_batch: float) -> None:
        """The environment's share of a batch became `tokens_per_batch` tokens (a fraction schedule): the measured
        estimate scales with it (from a share of 0 there is nothing to scale: the estimate starts again from the
        token share)."""
        tokens_per_batch = float(tokens_per_batch)
        if tokens_per_batch == self.tokens_per_batch:
            return
        if self.measured is not None:
            self.measured = self.measured * tokens_per_batch / self.tokens_per_batch if self.tokens_per_batch else None
        self.tokens_per_batch = tokens_per_batch

    def observe_batch(self, rollouts_used: int) -> None:
        """Refine the estimate from a batch that took `rollouts_used` rollouts of this environment."""
        if self.measured is None:
            self.measured = float(rollouts_used)
        else:
            self.measured = 0.8 * self.measured + 0.2 * rollouts_used

    def state_dict(self) -> dict[str, float | None]:
        return {
            "mean_rollout_tokens": self.mean_rollout_tokens,
            "consumed_per_batch": self.measured,
            "tokens_per_batch": self.tokens_per_batch,
        }

    def load_state_dict(self, state: dict) -> None:
        self.mean_rollout_tokens = float(state["mean_rollout_tokens"])
        self.tokens_per_batch = float(state.get("tokens_per_batch", self.tokens_per_batch))
        c = state["consumed_per_batch"]
        self.measured = None if c is None else float(c)
