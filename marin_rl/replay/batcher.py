"""Token-budget batcher: fills a batch round-robin over environments by token deficit and packs it.

Algorithm (v0, one call of `Batcher.try_make_batch`):

1. Every buffer drops rollouts older than `max_age` (so every trained token is at most `replay.max_age` versions
   older than the learner that trains on it). Rollouts longer than `max_seq_len` never reach the batcher: the
   buffers drop or truncate them on admission (`too_long`).
2. Targets (`selection.env_targets`): environment e gets `fraction_e × budget` tokens, `fraction_e` from the
   shares' schedule at the learner step that trains the batch (`marin_rl.replay.schedule`; constant without one).
   What the fractions leave over (they may sum to less than 1) is shared by the `remainder` strategy.
3. Shortfall: an environment holding less than `min_fill` of its share blocks the batch (`shortfall='block'`):
   `try_make_batch` returns a `BatchWait` naming the environments and the tokens they lack (a log line says the
   same), and after `block_timeout_s` it raises `BatchTimeoutError`. With `shortfall='fill'` the short environment
   contributes what it has and the others fill the gap (proportionally to what they have beyond their share).
4. Selection (`selection.select_within_targets`): round-robin over environments by largest remaining token
   deficit; each takes its newest rollout that still fits its deficit (so no environment exceeds its target).
5. Packing: the selected rollouts go into rows by `pack_rows` (the better of first- and best-fit-decreasing); any
   that do not fit return to the buffer, and the gaps left are filled (`selection.fill_gaps`), environment by
   largest deficit, with the newest rollouts that fit both the gap and the deficit (best fit). Last, an
   environment still short of its target may place the newest rollout that fits a gap even if it exceeds the
   deficit (it then ends above its target by less than that rollout). So an environment with data ends within one
   rollout of its target, unless none of its rollouts fits the space left.

The result is a `FormedBatch`: the packed batch, what each environment contributed (`EnvUsage`), the rollouts
placed and the `batches/...` metrics.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from marin_rl.bounds import bounded, check_fields
from marin_rl.replay.buffer import TOO_LONG_POLICIES, ReplayBuffer, ReplayItem, item_sequences
from marin_rl.replay.packing import pack, pack_rows
from marin_rl.replay.schedule import FractionSchedule
from marin_rl.replay.selection import env_targets, fill_gaps, select_within_targets
from marin_rl.types import PackedBatch

logger = logging.getLogger(__name__)

REMAINDER_STRATEGIES = ("proportional", "by_fraction", "none")
SHORTFALL_POLICIES = ("block", "fill")


class BatchTimeoutError(TimeoutError):
    """The batcher blocked on an environment's share for longer than `block_timeout_s`."""


@dataclass
class BatcherConfig:
    """How training batches are assembled."""

    total_token_budget: int = bounded(4096, ge=1)
    """Token slots per batch (rows × max_seq_len)."""
    max_seq_len: int = bounded(128, ge=1)
    """Length of one packed row; a longer rollout follows `too_long`."""
    min_fill: float = bounded(0.9, gt=0, le=1)
    """An environment blocks the batch until it holds this fraction of its share (see `shortfall`), in (0, 1]."""
    remainder: str = "proportional"
    """How budget the fractions leave over is filled: 'proportional' (to each environment's tokens beyond its
    share), 'by_fraction' (in proportion to the fractions), or 'none' (left empty)."""
    shortfall: str = "block"
    """When an environment holds less than `min_fill` of its share: 'block' (wait for it) or 'fill' (take what it
    has; the other environments fill the gap)."""
    block_timeout_s: float | None = bounded(600.0, gt=0)
    """With shortfall='block': raise `BatchTimeoutError` after blocking this long, naming the environments waited
    for (None: wait for ever)."""
    wait_log_min_s: float = bounded(5.0, ge=0)
    """While blocked, say nothing until the batcher has waited this long (short waits for the next groups are the
    normal rhythm of the loop), then log which environment is awaited and the tokens missing (0: log every wait)."""
    wait_log_interval_s: float = bounded(10.0, gt=0)
    """After that, repeat the line at most this often while still blocked."""
    too_long: str = "drop"
    """A rollout longer than `max_seq_len`: 'drop' it, or 'truncate' it to `max_seq_len` (loss only on the sampled
    tokens that survive; dropped if none survives). The replay buffers apply it on admission and count both."""

    @property
    def num_rows(self) -> int:
        return self.total_token_budget // self.max_seq_len

    def __post_init__(self):
        check_fields(self, "batcher")
        if self.total_token_budget < self.max_seq_len:
            raise ValueError(
                f"batcher.total_token_budget: must be at least batcher.max_seq_len ({self.max_seq_len}), got "
                f"{self.total_token_budget}"
            )
        for name, value, allowed in (
            ("remainder", self.remainder, REMAINDER_STRATEGIES),
            ("shortfall", self.shortfall, SHORTFALL_POLICIES),
            ("too_long", self.too_long, TOO_LONG_POLICIES),
        ):
            if value not in allowed:
                raise ValueError(f"batcher.{name} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class EnvUsage:
    """What one environment contributed to a batch."""

    rollouts: int
    """Rollouts placed."""
    tokens: int
    """Tokens they occupy."""
    target_tokens: float
    """The environment's token target for the batch."""


@dataclass
class FormedBatch:
    """A packed batch and how it was made."""

    batch: PackedBatch
    """The packed rows."""
    usage: dict[str, EnvUsage]
    """Per environment: rollouts and tokens used, and the target."""
    placed: list[tuple[ReplayItem, int]]
    """Every rollout placed, with its row."""
    metrics: dict[str, float]
    """`batches/...` metrics of the batch (with each environment's `BatchDraw`: groups and tokens sampled since the
    previous batch and trained in this one, `batches/{env}/oversampling/...`) and `replays/{env}/frac_used_in_batch`."""

    @property
    def num_rollouts(self) -> int:
        return len(self.placed)


@dataclass(frozen=True)
class BatchWait:
    """No batch: these environments hold less than `min_fill` of their share (tokens missing per environment)."""

    missing: dict[str, int]
    """Tokens each awaited environment lacks."""


class Batcher:
    """Builds packed batches from the replay buffers (algorithm in the module docstring)."""

    def __init__(
        self,
        config: BatcherConfig,
        buffers: dict[str, ReplayBuffer],
        fractions: dict[str, float] | None = None,
        schedule: FractionSchedule | None = None,
    ):
        self.config = config
        self.buffers = buffers
        names = list(buffers)
        if not names:
            raise ValueError("batcher: at least one replay buffer is required")
        if schedule is not None:
            fractions = schedule.at(1)
        fractions = fractions or {n: 1.0 / len(names) for n in names}
        if set(fractions) != set(names):
            raise ValueError(f"batch shares {sorted(fractions)} do not match the environments {sorted(names)}")
        if any(f < 0 for f in fractions.values()) or sum(fractions.values()) > 1 + 1e-6:
            raise ValueError(f"batch shares must be non-negative and sum to at most 1, got {fractions}")
        self.schedule = schedule if schedule is not None else FractionSchedule.constant(fractions)
        """Each environment's share at a learner step (`curriculum.fractions`; constant without one)."""
        self.fractions = dict(fractions)
        """The shares of the latest batch (the batch trained at learner step v + 1 uses `schedule.at(v + 1)`)."""
        self._blocked_since: float | None = None
        self._last_wait_log = 0.0

    @property
    def budget(self) -> int:
        """Token slots of one batch."""
        return self.config.num_rows * self.config.max_seq_len

    def _blocked(self, missing: dict[str, int], targets: dict[str, float], available: dict[str, int]) -> BatchWait:
        now = time.time()
        if self._blocked_since is None:
            self._blocked_since = now
        waited = now - self._blocked_since
        detail = ", ".join(
            f"{n} ({k} tokens missing: has {available[n]} of {targets[n]:.0f})" for n, k in missing.items()
        )
        long_wait = waited >= self.config.wait_log_min_s
        if long_wait and now - self._last_wait_log >= self.config.wait_log_interval_s:
            self._last_wait_log = now
            logger.info("batcher: waiting %.0fs for %s", waited, detail)
        if self.config.block_timeout_s is not None and waited > self.config.block_timeout_s:
            raise BatchTimeoutError(f"batcher: no batch for {waited:.0f}s; waiting for {detail}")
        return BatchWait(missing)

    def try_make_batch(self, learner_version: int) -> FormedBatch | BatchWait | None:
        """A packed batch for `learner_version` to train on; a `BatchWait` while blocked on an environment's share;
        None when the buffers hold nothing that can be placed."""
        cfg = self.config
        R, L = cfg.num_rows, cfg.max_seq_len
        names = list(self.buffers)
        if self.schedule.varies:
            self.fractions = self.schedule.at(learner_version + 1)
        for buf in self.buffers.values():
            buf.drop_stale(learner_version)
        queues = {n: self.buffers[n].newest_first() for n in names}
        lens = {
            n: np.fromiter((it.num_tokens for it in queues[n]), dtype=np.int64, count=len(queues[n])) for n in names
        }
        available = {n: int(lens[n].sum()) for n in names}

        budget = self.budget
        if cfg.shortfall == "block":
            base = {n: f * budget for n, f in self.fractions.items()}
            missing = {
                n: int(np.ceil(cfg.min_fill * t - available[n]))
                for n, t in base.items()
                if t > 0 and available[n] < cfg.min_fill * t
            }
            if missing:
                return self._blocked(missing, base, available)
        self._blocked_since = None
        targets = env_targets(self.fractions, budget, available, cfg.remainder, fill_shortfall=cfg.shortfall == "fill")

        # selection, then packing: what does not fit goes back, and the gaps are filled
        selected = select_within_targets(lens, targets)
        assignment = pack_rows([int(lens[e][i]) for e, i in selected], R, L)
        taken = {n: np.zeros(len(queues[n]), dtype=bool) for n in names}
        free = [L] * R
        placed: list[tuple[str, int, int]] = []
        for (env, i), row in zip(selected, assignment, strict=True):
            if row is not None:
                taken[env][i] = True
                free[row] -= int(lens[env][i])
                placed.append((env, i, row))
        placed += fill_gaps(lens, taken, targets, free)
        if not placed:
            return None

        items = [(queues[env][i], row) for env, i, row in placed]
        batch, _ = pack(item_sequences([it for it, _ in items]), R, L, assignment=[row for _, row in items])
        used = {n: [queues[n][i] for i in np.flatnonzero(taken[n])] for n in names}
        usage = {
            n: EnvUsage(rollouts=len(used[n]), tokens=sum(it.num_tokens for it in used[n]), target_tokens=targets[n])
            for n in names
        }
        metrics = self._metrics(batch, used, usage, learner_version)
        for n in names:
            waiting = len(self.buffers[n])
            metrics[f"replays/{n}/frac_used_in_batch"] = len(used[n]) / waiting if waiting else 0.0
            metrics.update(self.buffers[n].consume(used[n]).metrics(f"batches/{n}"))
        return FormedBatch(batch=batch, usage=usage, placed=items, metrics=metrics)

    def _metrics(
        self,
        batch: PackedBatch,
        used: dict[str, list[ReplayItem]],
        usage: dict[str, EnvUsage],
        learner_version: int,
    ) -> dict[str, float]:
        real = batch.segment_ids >= 0
        lag = learner_version - batch.token_versions[batch.loss_mask]
        total = max(int(real.sum()), 1)
        out: dict[str, float] = {
            "batches/packing_efficiency": float(real.mean()),
            "batches/rollouts": sum(u.rollouts for u in usage.values()),
            "batches/tokens": int(real.sum()),
            "batches/trained_tokens": int(batch.loss_mask.sum()),
            "batches/staleness/mean": float(lag.mean()) if lag.size else 0.0,
            "batches/staleness/max": int(lag.max()) if lag.size else 0,
        }
        for n, u in usage.items():
            out[f"batches/{n}/rollouts_used"] = u.rollouts
            out[f"batches/{n}/tokens_used"] = u.tokens
            out[f"batches/{n}/frac_used"] = u.tokens / total
            out[f"batches/{n}/target_tokens"] = u.target_tokens
            out[f"batches/{n}/fraction"] = self.fractions[n]
            if used[n]:
                out[f"batches/{n}/reward/mean"] = float(np.mean([it.rollout.reward for it in used[n]]))
        return out
