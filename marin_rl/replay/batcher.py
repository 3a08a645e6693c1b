"""Token-budget batcher: fills a batch round-robin over environments by token deficit and packs it."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from marin_rl.replay.buffer import ReplayBuffer, ReplayItem
from marin_rl.replay.packing import Sequence, pack
from marin_rl.types import PackedBatch

logger = logging.getLogger(__name__)


@dataclass
class BatcherConfig:
    """How training batches are assembled."""

    total_token_budget: int = 4096
    """Token slots per batch (rows × max_seq_len)."""
    max_seq_len: int = 128
    """Length of one packed row; a rollout longer than this is dropped (and counted)."""
    min_fill: float = 0.9
    """A batch is emitted once this fraction of each environment's share is filled (or nothing more fits)."""

    @property
    def num_rows(self) -> int:
        return self.total_token_budget // self.max_seq_len

    def __post_init__(self):
        if self.total_token_budget < self.max_seq_len:
            raise ValueError("batcher.total_token_budget must be at least batcher.max_seq_len")
        if not 0 < self.min_fill <= 1:
            raise ValueError("batcher.min_fill must be in (0, 1]")


class Batcher:
    """Builds `PackedBatch`es from the replay buffers.

    v0 policy: each environment's share is `fraction × total_token_budget`. Items are taken newest first,
    round-robin by largest remaining deficit, and placed into rows by best fit. If an environment with a
    share has less than `min_fill` of it available, no batch is made (the caller waits and retries).
    """

    def __init__(
        self, config: BatcherConfig, buffers: dict[str, ReplayBuffer], fractions: dict[str, float] | None = None
    ):
        self.config = config
        self.buffers = buffers
        names = list(buffers)
        fractions = fractions or {n: 1.0 / len(names) for n in names}
        if set(fractions) != set(names):
            raise ValueError(f"batch shares {sorted(fractions)} do not match the environments {sorted(names)}")
        if any(f < 0 for f in fractions.values()) or sum(fractions.values()) > 1 + 1e-6:
            raise ValueError(f"batch shares must be non-negative and sum to at most 1, got {fractions}")
        self.fractions = dict(fractions)
        self.dropped_too_long = 0
        self.waiting_for: dict[str, int] = {}

    def try_make_batch(self, learner_version: int) -> tuple[PackedBatch, dict[str, float]] | None:
        """A packed batch and its `batches/...` metrics, or None while some environment lacks data."""
        cfg = self.config
        for buf in self.buffers.values():
            buf.drop_stale(learner_version)
            too_long = [it for it in buf.items if it.num_tokens > cfg.max_seq_len]
            if too_long:
                self.dropped_too_long += len(too_long)
                buf.discard(too_long)
                logger.warning(
                    "batcher: dropped %d rollouts of %s longer than max_seq_len", len(too_long), buf.env_name
                )
        budget = cfg.num_rows * cfg.max_seq_len
        targets = {n: f * budget for n, f in self.fractions.items()}
        self.waiting_for = {
            n: int(cfg.min_fill * t - self.buffers[n].num_tokens)
            for n, t in targets.items()
            if t > 0 and self.buffers[n].num_tokens < cfg.min_fill * t
        }
        if self.waiting_for:
            return None

        free = [cfg.max_seq_len] * cfg.num_rows
        taken: dict[str, list[ReplayItem]] = {n: [] for n in self.buffers}
        got = dict.fromkeys(self.buffers, 0)
        queues = {n: self.buffers[n].newest_first() for n in self.buffers}
        rows_of: list[tuple[ReplayItem, int]] = []
        while True:
            open_envs = [n for n in self.buffers if queues[n] and got[n] < targets[n]]
            if not open_envs:
                break
            env = max(open_envs, key=lambda n: targets[n] - got[n])
            item = queues[env].pop(0)
            fits = [r for r in range(cfg.num_rows) if free[r] >= item.num_tokens]
            if not fits:
                continue  # does not fit anywhere now; a shorter one may
            row = min(fits, key=lambda r: free[r])  # best fit
            free[row] -= item.num_tokens
            taken[env].append(item)
            got[env] += item.num_tokens
            rows_of.append((item, row))

        if not rows_of:
            return None
        sequences = [Sequence.from_rollout(it.rollout, it.advantage) for it, _ in rows_of]
        batch, _ = pack(sequences, cfg.num_rows, cfg.max_seq_len, assignment=[row for _, row in rows_of])
        for n, used in taken.items():
            self.buffers[n].consume(used)
        return batch, self._metrics(batch, taken, learner_version)

    def _metrics(self, batch: PackedBatch, taken: dict[str, list[ReplayItem]], learner_version: int) -> dict:
        real = batch.segment_ids >= 0
        lag = learner_version - batch.version[batch.loss_mask]
        total = max(int(real.sum()), 1)
        out = {
            "batches/packing_efficiency": float(real.mean()),
            "batches/rollouts": sum(len(v) for v in taken.values()),
            "batches/tokens": int(real.sum()),
            "batches/trained_tokens": int(batch.loss_mask.sum()),
            "batches/staleness/mean": float(lag.mean()) if lag.size else 0.0,
            "batches/staleness/max": int(lag.max()) if lag.size else 0,
            "batches/dropped_too_long": self.dropped_too_long,
        }
        for n, used in taken.items():
            toks = sum(it.num_tokens for it in used)
            out[f"batches/{n}/rollouts_used"] = len(used)
            out[f"batches/{n}/tokens_used"] = toks
            out[f"batches/{n}/frac_used"] = toks / total
            if used:
                out[f"batches/{n}/reward/mean"] = float(np.mean([it.rollout.reward for it in used]))
        return out
