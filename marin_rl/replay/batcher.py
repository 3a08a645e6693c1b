"""Token-budget batcher: fills a batch round-robin over environments by token deficit and packs it.

Algorithm (v0, one call of `Batcher.try_make_batch`):

1. Every buffer drops rollouts older than `max_age`; rollouts longer than `max_seq_len` are dropped or truncated
   and marked (`too_long`), and counted.
2. Targets: environment e gets `fraction_e × budget` tokens. What the fractions leave over (they may sum to
   less than 1) is shared by the `remainder` strategy: 'proportional' to the tokens each environment has beyond
   its share, 'by_fraction' in proportion to the fractions, or 'none' (left as padding).
3. Shortfall: an environment holding less than `min_fill` of its share blocks the batch (`shortfall='block'`):
   `try_make_batch` returns None, `waiting_for` says which environments lack how many tokens, a log line says the
   same, and after `block_timeout_s` it raises `BatchTimeoutError`. With `shortfall='fill'` the short environment
   contributes what it has and the others fill the gap (proportionally to what they have beyond their share).
4. Selection: round-robin over environments by largest remaining token deficit; each takes its newest rollout
   that still fits its deficit (so no environment exceeds its target).
5. Packing: the selected rollouts go into rows by `pack_rows` (the better of first- and best-fit-decreasing); any
   that do not fit return to the buffer, and the gaps left are filled, environment by largest deficit, with the
   newest rollouts that fit both the gap and the deficit (best fit). Last, an environment still short of its
   target may place the newest rollout that fits a gap even if it exceeds the deficit (it then ends above its
   target by less than that rollout). So an environment with data ends within one rollout of its target, unless
   none of its rollouts fits the space left.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from marin_rl.replay.buffer import ReplayBuffer, ReplayItem
from marin_rl.replay.packing import pack, pack_rows
from marin_rl.types import PackedBatch

logger = logging.getLogger(__name__)

REMAINDER_STRATEGIES = ("proportional", "by_fraction", "none")
SHORTFALL_POLICIES = ("block", "fill")
TOO_LONG_POLICIES = ("drop", "truncate")


class BatchTimeoutError(TimeoutError):
    """The batcher blocked on an environment's share for longer than `block_timeout_s`."""


@dataclass
class BatcherConfig:
    """How training batches are assembled."""

    total_token_budget: int = 4096
    """Token slots per batch (rows × max_seq_len)."""
    max_seq_len: int = 128
    """Length of one packed row; a longer rollout follows `too_long`."""
    min_fill: float = 0.9
    """An environment blocks the batch until it holds this fraction of its share (see `shortfall`)."""
    remainder: str = "proportional"
    """How budget the fractions leave over is filled: 'proportional' (to each environment's tokens beyond its
    share), 'by_fraction' (in proportion to the fractions), or 'none' (left empty)."""
    shortfall: str = "block"
    """When an environment holds less than `min_fill` of its share: 'block' (wait for it) or 'fill' (take what it
    has; the other environments fill the gap)."""
    block_timeout_s: float | None = None
    """With shortfall='block': raise `BatchTimeoutError` after blocking this long (None: wait for ever; the
    orchestrator's `batch_timeout_s` still applies)."""
    wait_log_interval_s: float = 10.0
    """While blocked, log which environment is awaited (and the tokens missing) at most this often."""
    too_long: str = "drop"
    """A rollout longer than `max_seq_len`: 'drop' it, or 'truncate' it to `max_seq_len` and mark it truncated
    (loss only on the sampled tokens that survive; dropped if none survives). Both are counted."""

    @property
    def num_rows(self) -> int:
        return self.total_token_budget // self.max_seq_len

    def __post_init__(self):
        if self.max_seq_len < 1:
            raise ValueError("batcher.max_seq_len must be >= 1")
        if self.total_token_budget < self.max_seq_len:
            raise ValueError("batcher.total_token_budget must be at least batcher.max_seq_len")
        if not 0 < self.min_fill <= 1:
            raise ValueError("batcher.min_fill must be in (0, 1]")
        for name, value, allowed in (
            ("remainder", self.remainder, REMAINDER_STRATEGIES),
            ("shortfall", self.shortfall, SHORTFALL_POLICIES),
            ("too_long", self.too_long, TOO_LONG_POLICIES),
        ):
            if value not in allowed:
                raise ValueError(f"batcher.{name} must be one of {allowed}, got {value!r}")
        if self.block_timeout_s is not None and self.block_timeout_s <= 0:
            raise ValueError("batcher.block_timeout_s must be positive (or None)")


def _share_out(amount: float, weights: dict[str, float], caps: dict[str, float] | None) -> dict[str, float]:
    """Split `amount` by `weights`, never giving an env more than its cap (what is left over is not handed out)."""
    extra = dict.fromkeys(weights, 0.0)
    open_ = {n for n, w in weights.items() if w > 0 and (caps is None or caps[n] > 0)}
    while amount > 1e-9 and open_:
        total = sum(weights[n] for n in open_)
        given = 0.0
        for n in list(open_):
            portion = amount * weights[n] / total
            if caps is not None:
                portion = min(portion, caps[n] - extra[n])
                if caps[n] - extra[n] - portion <= 1e-9:
                    open_.discard(n)
            extra[n] += portion
            given += portion
        amount -= given
        if caps is None or given <= 1e-12:
            break
    return extra


def env_targets(
    fractions: dict[str, float],
    budget: int,
    available: dict[str, int],
    remainder: str = "proportional",
    fill_shortfall: bool = False,
) -> dict[str, float]:
    """Token target of each environment for one batch (a pure function; see the module docstring)."""
    base = {n: f * budget for n, f in fractions.items()}
    shortfall = 0.0
    if fill_shortfall:
        for n in base:
            if available[n] < base[n]:
                shortfall += base[n] - available[n]
                base[n] = float(available[n])
    rest = max(0.0, budget - sum(fractions.values()) * budget)
    surplus = {n: max(0.0, available[n] - base[n]) for n in base}
    extra = dict.fromkeys(base, 0.0)
    if remainder == "proportional":
        extra = _share_out(rest + shortfall, surplus, surplus)
    else:
        if remainder == "by_fraction" and rest > 0:
            weights = fractions if sum(fractions.values()) > 0 else dict.fromkeys(fractions, 1.0)
            extra = _share_out(rest, weights, None)
        if shortfall > 0:
            caps = {n: max(0.0, surplus[n] - extra[n]) for n in base}
            more = _share_out(shortfall, caps, caps)
            extra = {n: extra[n] + more[n] for n in base}
    return {n: base[n] + extra[n] for n in base}


class Batcher:
    """Builds `PackedBatch`es from the replay buffers (algorithm in the module docstring).

    After each batch, `last_items` lists `(item, row)` for every rollout placed, and `waiting_for` is empty; while
    blocked, `waiting_for` maps each awaited environment to the tokens it is missing.
    """

    def __init__(
        self, config: BatcherConfig, buffers: dict[str, ReplayBuffer], fractions: dict[str, float] | None = None
    ):
        self.config = config
        self.buffers = buffers
        names = list(buffers)
        if not names:
            raise ValueError("batcher: at least one replay buffer is required")
        fractions = fractions or {n: 1.0 / len(names) for n in names}
        if set(fractions) != set(names):
            raise ValueError(f"batch shares {sorted(fractions)} do not match the environments {sorted(names)}")
        if any(f < 0 for f in fractions.values()) or sum(fractions.values()) > 1 + 1e-6:
            raise ValueError(f"batch shares must be non-negative and sum to at most 1, got {fractions}")
        self.fractions = dict(fractions)
        self.dropped_too_long: dict[str, int] = dict.fromkeys(names, 0)
        self.truncated_too_long: dict[str, int] = dict.fromkeys(names, 0)
        self.waiting_for: dict[str, int] = {}
        self.last_items: list[tuple[ReplayItem, int]] = []
        self._blocked_since: float | None = None
        self._last_wait_log = 0.0

    @property
    def budget(self) -> int:
        """Token slots of one batch."""
        return self.config.num_rows * self.config.max_seq_len

    # ---- checkpoint state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, int]]:
        """The batcher's own state (its too-long counters), JSON-compatible; the rollouts live in the buffers."""
        return {"dropped_too_long": dict(self.dropped_too_long), "truncated_too_long": dict(self.truncated_too_long)}

    def load_state_dict(self, state: dict[str, dict[str, int]]) -> None:
        """Restore `state_dict()`'s output; raises ValueError if it names other environments."""
        for key in ("dropped_too_long", "truncated_too_long"):
            if set(state[key]) != set(self.buffers):
                raise ValueError(f"batcher state covers envs {sorted(state[key])}, this run has {sorted(self.buffers)}")
            setattr(self, key, {n: int(state[key][n]) for n in self.buffers})

    # ---- preparation ----------------------------------------------------------------------------------
    def _handle_too_long(self, buf: ReplayBuffer) -> None:
        L = self.config.max_seq_len
        too_long = [it for it in buf.items if it.num_tokens > L]
        if not too_long:
            return
        drop = too_long
        if self.config.too_long == "truncate":
            drop = []
            for it in too_long:
                if not it.rollout.loss_mask()[:L].any():
                    drop.append(it)  # nothing sampled survives the cut: nothing to train on
                    continue
                it.rollout.metadata["truncated"] = True
                it.rollout.metadata["truncated_from_tokens"] = it.rollout.num_tokens
                it.max_len = L
                it.num_tokens = L
                self.truncated_too_long[buf.env_name] += 1
            if len(drop) < len(too_long):
                logger.info(
                    "batcher: truncated %d rollouts of %s to max_seq_len=%d", len(too_long) - len(drop), buf.env_name, L
                )
        if drop:
            self.dropped_too_long[buf.env_name] += len(drop)
            buf.discard(drop, reason="too_long")
            logger.warning("batcher: dropped %d rollouts of %s longer than max_seq_len=%d", len(drop), buf.env_name, L)

    def _blocked(self, missing: dict[str, int], targets: dict[str, float], available: dict[str, int]) -> None:
        now = time.time()
        if self._blocked_since is None:
            self._blocked_since = now
        waited = now - self._blocked_since
        detail = ", ".join(
            f"{n} ({k} tokens missing: has {available[n]} of {targets[n]:.0f})" for n, k in missing.items()
        )
        if now - self._last_wait_log >= self.config.wait_log_interval_s:
            self._last_wait_log = now
            logger.info("batcher: waiting %.0fs for %s", waited, detail)
        if self.config.block_timeout_s is not None and waited > self.config.block_timeout_s:
            raise BatchTimeoutError(f"batcher: no batch for {waited:.0f}s; waiting for {detail}")

    # ---- the batch ------------------------------------------------------------------------------------
    def try_make_batch(self, learner_version: int) -> tuple[PackedBatch, dict[str, float]] | None:
        """A packed batch and its `batches/...` and `replays/...` metrics, or None while blocked on an env."""
        cfg = self.config
        R, L = cfg.num_rows, cfg.max_seq_len
        names = list(self.buffers)
        for buf in self.buffers.values():
            buf.drop_stale(learner_version)
            self._handle_too_long(buf)
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
            self.waiting_for = missing
            if missing:
                self._blocked(missing, base, available)
                return None
        else:
            self.waiting_for = {}
        self._blocked_since = None
        targets = env_targets(self.fractions, budget, available, cfg.remainder, fill_shortfall=cfg.shortfall == "fill")

        # -- selection: round-robin by deficit, newest first, never past an env's target
        taken = {n: np.zeros(len(queues[n]), dtype=bool) for n in names}
        got = dict.fromkeys(names, 0)
        ptr = dict.fromkeys(names, 0)
        selected: list[tuple[str, int]] = []
        open_envs = {n for n in names if targets[n] >= 1 and len(queues[n])}
        while open_envs:
            env = max(open_envs, key=lambda n: targets[n] - got[n])
            deficit = targets[env] - got[env]
            fits = np.flatnonzero(lens[env][ptr[env] :] <= deficit)
            if not fits.size:
                open_envs.discard(env)
                continue
            i = ptr[env] + int(fits[0])
            ptr[env] = i + 1
            taken[env][i] = True
            got[env] += int(lens[env][i])
            selected.append((env, i))

        # -- packing: better of FFD/BFD over the selected set; what does not fit goes back
        assignment = pack_rows([int(lens[e][i]) for e, i in selected], R, L)
        free = [L] * R
        placed: list[tuple[str, int, int]] = []
        for (env, i), row in zip(selected, assignment, strict=True):
            if row is None:
                taken[env][i] = False
                got[env] -= int(lens[env][i])
            else:
                free[row] -= int(lens[env][i])
                placed.append((env, i, row))

        # -- fill the gaps: env by largest deficit, newest rollout fitting a gap (best fit) and, first, the deficit;
        #    then (`overshoot`) one that only fits a gap, which may take the env past its target by < 1 rollout
        for overshoot in (False, True):
            open_envs = {n for n in names if targets[n] - got[n] >= (1e-9 if overshoot else 1)}
            while open_envs:
                env = max(open_envs, key=lambda n: targets[n] - got[n])
                limit = max(free) if overshoot else min(targets[env] - got[env], max(free))
                fits = np.flatnonzero((lens[env] <= limit) & ~taken[env])
                if not fits.size:
                    open_envs.discard(env)
                    continue
                i = int(fits[0])
                n_tok = int(lens[env][i])
                row = min((r for r in range(R) if free[r] >= n_tok), key=lambda r: free[r])
                free[row] -= n_tok
                taken[env][i] = True
                got[env] += n_tok
                placed.append((env, i, row))
                if overshoot and got[env] >= targets[env]:
                    open_envs.discard(env)

        if not placed:
            return None
        items = [(queues[env][i], row) for env, i, row in placed]
        batch, _ = pack([it.sequence() for it, _ in items], R, L, assignment=[row for _, row in items])
        used = {n: [queues[n][i] for i in np.flatnonzero(taken[n])] for n in names}
        metrics = self._metrics(batch, used, learner_version, targets)
        for n in names:
            metrics.update(self.buffers[n].metrics(learner_version, used_in_batch=len(used[n])))
            self.buffers[n].consume(used[n])
        self.last_items = items
        return batch, metrics

    def _metrics(
        self, batch: PackedBatch, used: dict[str, list[ReplayItem]], learner_version: int, targets: dict[str, float]
    ) -> dict[str, float]:
        real = batch.segment_ids >= 0
        lag = learner_version - batch.version[batch.loss_mask]
        total = max(int(real.sum()), 1)
        out: dict[str, float] = {
            "batches/packing_efficiency": float(real.mean()),
            "batches/rollouts": sum(len(v) for v in used.values()),
            "batches/tokens": int(real.sum()),
            "batches/trained_tokens": int(batch.loss_mask.sum()),
            "batches/staleness/mean": float(lag.mean()) if lag.size else 0.0,
            "batches/staleness/max": int(lag.max()) if lag.size else 0,
            "batches/dropped_too_long": sum(self.dropped_too_long.values()),
            "batches/truncated_too_long": sum(self.truncated_too_long.values()),
        }
        for n, items in used.items():
            toks = sum(it.num_tokens for it in items)
            out[f"batches/{n}/rollouts_used"] = len(items)
            out[f"batches/{n}/tokens_used"] = toks
            out[f"batches/{n}/frac_used"] = toks / total
            out[f"batches/{n}/target_tokens"] = targets[n]
            out[f"batches/{n}/dropped_too_long"] = self.dropped_too_long[n]
            out[f"batches/{n}/truncated_too_long"] = self.truncated_too_long[n]
            if items:
                out[f"batches/{n}/reward/mean"] = float(np.mean([it.rollout.reward for it in items]))
        return out
