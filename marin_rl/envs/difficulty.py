"""Difficulty-aware problem sampling: problems are drawn with weights from their recent pass rate.

`PassRateSampler` is a `ProblemIterator` (same tickets, hand-out-again rule and checkpoint state) whose new problems
are drawn at random, with weights that favour a learnable band of difficulty, as prime-rl's difficulty pools do:

* Each group delivered reports its rollouts' rewards (`done(ticket, rewards)`); its pass rate is the fraction of
  rollouts whose reward is at least `pass_reward`. A problem's pass rate is an exponential moving average of its
  groups' pass rates, p ← (1 − s)·p + s·new with s = `smoothing` (its first group sets it).
* Buckets and weights: a problem never reported is *unseen* (weight `unseen_weight`, the prior); one with
  p < `low` is *hard* (`hard_weight`), p > `high` *easy* (`easy_weight`), otherwise *learnable* (weight 1).
* The statistics change once per batch (`refresh()`, which the rollout controller calls for every batch formed):
  results reported since the last refresh are applied then, in the order their problems were drawn. Between two
  refreshes problems are drawn without replacement (a problem drawn since the last refresh has weight 0); once
  every weighted problem is drawn they are drawn with replacement, and when no problem has weight, uniformly.
* Draw k takes one uniform number from `default_rng([seed, stream, 1, k])`; its ticket is `(index, k)`. So the
  problems drawn are a pure function of the seed, the stream and the history of results reported and refreshes,
  and a sampler restored from `state_dict()` draws what the original would have drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from marin_rl.bounds import bounded, check_fields
from marin_rl.envs.iteration import ProblemIterator, ProblemTicket, stream_id

BUCKETS = ("unseen", "hard", "learnable", "easy")
"""Difficulty buckets, in the order of their codes (0..3)."""
UNSEEN, HARD, LEARNABLE, EASY = range(4)


@dataclass
class PassRateConfig:
    """Difficulty-aware problem sampling (`curriculum.problems: pass_rate`): weights from each problem's pass rate."""

    low: float = bounded(0.1, ge=0, le=1)
    """Pass rates below this are 'hard', in [0, 1]."""
    high: float = bounded(0.9, ge=0, le=1)
    """Pass rates above this are 'easy', in [0, 1] and >= `low`; in between (bounds included) is 'learnable'."""
    smoothing: float = bounded(0.5, gt=0, le=1)
    """Weight of a problem's newest group in its pass-rate moving average, in (0, 1] (1: the last group only)."""
    unseen_weight: float = bounded(1.0, ge=0)
    """Sampling weight of a problem never reported yet (the prior), relative to a learnable problem's 1 (0: never
    drawn while others are)."""
    easy_weight: float = bounded(0.1, ge=0)
    """Sampling weight of an easy problem, relative to a learnable problem's 1 (0: never drawn while others are)."""
    hard_weight: float = bounded(0.1, ge=0)
    """Sampling weight of a hard problem, relative to a learnable problem's 1 (0: never drawn while others are)."""
    pass_reward: dict[str, float] = field(default_factory=dict)
    """Per environment name, the episode reward at which a rollout counts as passed (environments not named: 1.0,
    an exact answer in the shipped single-turn environments)."""

    def __post_init__(self):
        check_fields(self, "curriculum.pass_rate")
        if self.low > self.high:
            raise ValueError(
                f"curriculum.pass_rate.high: must be >= curriculum.pass_rate.low ({self.low}), got {self.high}"
            )

    def reward_to_pass(self, env: str) -> float:
        """The reward at which a rollout of environment `env` counts as passed."""
        return float(self.pass_reward.get(env, 1.0))


class PassRateSampler(ProblemIterator):
    """Draws problems with weights from their recent pass rate (module docstring); tickets, `requeue`, `outstanding`
    and the redo on resume are `ProblemIterator`'s."""

    SAMPLER = "pass_rate"

    def __init__(self, num_problems: int, seed: int, stream: int, config: PassRateConfig, pass_reward: float = 1.0):
        super().__init__(num_problems, seed, stream)
        self.config = config
        self.pass_reward = float(pass_reward)
        self.draws = 0
        """Problems drawn so far (the next draw's number)."""
        self.pass_rate = np.zeros(self.num_problems)
        """Each problem's pass-rate moving average (meaningful where `reported` > 0)."""
        self.reported = np.zeros(self.num_problems, dtype=np.int64)
        """Groups of each problem applied to `pass_rate`."""
        self._pending: list[tuple[int, int, float]] = []  # (draw, index, group pass rate) since the last refresh
        self._drawn: set[int] = set()  # problems drawn since the last refresh
        self._window = np.zeros(len(BUCKETS), dtype=np.int64)  # draws per bucket since the last metrics call
        self._update_weights()

    def buckets(self) -> np.ndarray:
        """Each problem's bucket code (`BUCKETS`), from the statistics as of the last refresh."""
        cfg = self.config
        codes = np.full(self.num_problems, LEARNABLE, dtype=np.int64)
        codes[self.pass_rate < cfg.low] = HARD
        codes[self.pass_rate > cfg.high] = EASY
        codes[self.reported == 0] = UNSEEN
        return codes

    def weights(self) -> np.ndarray:
        """Each problem's sampling weight by its bucket, before the without-replacement rule."""
        cfg = self.config
        by_bucket = np.array([cfg.unseen_weight, cfg.hard_weight, 1.0, cfg.easy_weight])
        return by_bucket[self.buckets()]

    def _update_weights(self) -> None:
        self._codes = self.buckets()
        self._weights = self.weights()

    def _draw(self) -> ProblemTicket:
        w = self._weights.copy()
        if self._drawn:
            w[list(self._drawn)] = 0.0
        if w.sum() <= 0:
            w = self._weights.copy()
        if w.sum() <= 0:
            w = np.ones(self.num_problems)
        cdf = np.cumsum(w)
        u = np.random.default_rng([self.seed, self.stream, 1, self.draws]).random()
        index = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), self.num_problems - 1)
        ticket = ProblemTicket(index, self.draws)
        self.draws += 1
        self._drawn.add(index)
        self._window[self._codes[index]] += 1
        return ticket

    def done(self, ticket: ProblemTicket, rewards: Sequence[float] = ()) -> None:
        """The ticket's group was delivered; its rewards (when it could be read) are applied at the next refresh."""
        super().done(ticket)
        if len(rewards):
            passed = float(np.mean(np.asarray(rewards, dtype=np.float64) >= self.pass_reward))
            self._pending.append((ticket.epoch, ticket.index, passed))

    def refresh(self) -> None:
        """Apply the results reported since the last refresh (in draw order) and start a new round of draws."""
        a = self.config.smoothing
        for _, index, passed in sorted(self._pending):
            first = self.reported[index] == 0
            self.pass_rate[index] = passed if first else (1 - a) * self.pass_rate[index] + a * passed
            self.reported[index] += 1
        self._pending = []
        self._drawn = set()
        self._update_weights()

    def metrics(self, env: str) -> dict[str, float]:
        """Per bucket: `problems/{env}/{bucket}/count` (problems in it), `.../pass_rate` (their mean pass rate, for
        the seen buckets that hold any) and `.../draw_frac` (the share of the draws since the last call)."""
        out: dict[str, float] = {}
        drawn = int(self._window.sum())
        for code, bucket in enumerate(BUCKETS):
            members = self._codes == code
            out[f"problems/{env}/{bucket}/count"] = float(members.sum())
            if code != UNSEEN and members.any():
                out[f"problems/{env}/{bucket}/pass_rate"] = float(self.pass_rate[members].mean())
            out[f"problems/{env}/{bucket}/draw_frac"] = float(self._window[code] / drawn) if drawn else 0.0
        self._window[:] = 0
        return out

    def state_dict(self) -> dict[str, Any]:
        """`ProblemIterator`'s state plus the draw count, the statistics, the results not yet applied, the problems
        drawn since the last refresh and the metrics window."""
        seen = np.flatnonzero(self.reported)
        return {
            **super().state_dict(),
            "sampler": self.SAMPLER,
            "draws": self.draws,
            "stats": [[int(i), float(self.pass_rate[i]), int(self.reported[i])] for i in seen],
            "pending": [[d, i, p] for d, i, p in self._pending],
            "drawn": sorted(self._drawn),
            "window": [int(x) for x in self._window],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s output (ValueError for another order or problem set)."""
        super().load_state_dict(state)
        self.draws = int(state["draws"])
        self.pass_rate = np.zeros(self.num_problems)
        self.reported = np.zeros(self.num_problems, dtype=np.int64)
        for i, rate, n in state["stats"]:
            self.pass_rate[int(i)], self.reported[int(i)] = float(rate), int(n)
        self._pending = [(int(d), int(i), float(p)) for d, i, p in state["pending"]]
        self._drawn = {int(i) for i in state["drawn"]}
        self._window = np.asarray(state["window"], dtype=np.int64)
        self._update_weights()


def problem_order(num_problems: int, seed: int, env: str, pass_rate: PassRateConfig | None) -> ProblemIterator:
    """The problem order of environment `env`: the seeded shuffle (`ProblemIterator`), or with `pass_rate` the
    pass-rate sampler."""
    if pass_rate is None:
        return ProblemIterator(num_problems, seed, stream_id(env))
    return PassRateSampler(num_problems, seed, stream_id(env), pass_rate, pass_rate.reward_to_pass(env))
