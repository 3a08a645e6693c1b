"""Per-environment replay buffer: validates groups, computes advantages, drops stale rollouts, persists and reports.

Life of a group: `admit` runs four steps. `validate` checks it once (`marin_rl.replay.validation.check_group`, which
runs every rollout's `validate` with the vocabulary; the API's `InferenceEngine` and `make_batch` run the same check),
then the future-version check and the group filters (`min_group_size`, optional zero-variance filter). `score`
computes advantages with the configured estimator (`replay.advantage_estimator`, a name in the registry of
`marin_rl.replay.advantages`; an estimator may reject a group too). `persist` appends the rollouts to Parquet (when
the buffer has a `rollout_dir`; each row names the run segment and the group's place in the accepted groups, so a
reader can tell the timeline a resume or rollback kept from the one it discarded: `begin_segment`,
`marin_rl.replay.store`). `enqueue` discards rollouts already older than `max_age`, handles rollouts longer
than a batch row (`too_long`: dropped, or truncated to `max_tokens` when something sampled survives the cut), drops
the rollouts an environment marked untrainable (`types.DROP_REASON`, counted under `replays/{env}/dropped/{reason}`;
their rewards count in the group's advantages), queues the rest and evicts past `capacity`. It returns an `Admission`:
accepted, or rejected with a reason code (counted under `replays/{env}/rejected/{reason}`), with what it queued and
discarded. Rollouts leave the buffer by being used `max_reuse` times (`consume`), by growing older than `max_age`
learner steps (on arrival and in `drop_stale`), or by eviction when the buffer is over `capacity` (oldest arrival
first). Every exit is counted.

Dynamic sampling (DAPO, Yu et al. 2025; `dynamic_sampling`): after scoring, a group whose advantages are all zero
(every rollout's, and every token's when the estimator gives per-token ones) is rejected (`zero_advantage`), so no
batch trains on it; the batcher keeps waiting for new groups (and the staleness gate lets generation go on while it
waits) until the batch is full. What it costs is counted whether or not it is on: every group that arrives is
*sampled* (`sampled_groups`, `sampled_tokens`: the tokens the policy sampled in it), a group is *trained* the first time
one of its rollouts goes into a batch (`trained_groups`) and every sampled token placed in a batch is trained
(`trained_tokens`); `replays/{env}/oversampling/groups` = sampled / trained groups and `.../tokens` likewise, over the
run; `consume` returns the same four counts since the previous batch (`BatchDraw`, reported as `batches/{env}/...`).

`admit(group, max_version=v)` rejects (reason `future_version`) a group with a token sampled by a policy version
newer than v: after a resume from a checkpoint, a server that still served the lost run's later weights must not feed
them to the restored learner; the caller samples its problem again.

Metrics: `metrics()` reads (no side effect); the `new_*` and reward figures cover the groups admitted since the last
`start_window()`. `state_dict()` / `load_state_dict()` save and restore the waiting rollouts, the counters and the
advantage estimator's state (JSON-compatible, for checkpoints).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from marin_rl.bounds import bounded, check_fields
from marin_rl.replay.advantages import GroupAdvantages, GroupScores, get_estimator
from marin_rl.replay.packing import Sequence
from marin_rl.replay.store import RolloutWriter, read_timeline, record_segment
from marin_rl.replay.validation import GroupRejected, check_group
from marin_rl.types import DROP_REASON, Rollout, RolloutFormatError, RolloutGroup

logger = logging.getLogger(__name__)


@dataclass
class ReplayConfig:
    """Replay buffers (one per environment)."""

    min_group_size: int = bounded(2, ge=1)
    """Groups with fewer rollouts are rejected (advantages need company)."""
    max_age: int = bounded(4, ge=0)
    """A rollout whose oldest sampled token is more than this many learner steps old is discarded (0: only rollouts
    sampled entirely by the current policy version are trained on)."""
    capacity: int = bounded(65536, ge=1)
    """Most rollouts held per buffer; past it the oldest arrivals are evicted first (and counted)."""
    max_reuse: int = bounded(1, ge=1)
    """How many batches a rollout may appear in."""
    advantage_estimator: str = "rloo"
    """'rloo', 'grpo', 'dr_grpo', 'reinforce' (running baseline) or 'remax' (each group's env actor also samples a
    greedy episode, whose reward is the baseline), see marin_rl.replay.advantages; 'turn_rloo' (one advantage per
    policy turn: the turn's return against the group's other episodes' return from the same turn, `turn_lambda`); or
    'gae': no group advantage, the batches carry per-token rewards and the learner's critic computes advantages
    (`learner.critic.enabled`); or an estimator registered with `marin_rl.replay.advantages.register_estimator`
    ('package.module:NAME' imports its module first)."""
    gae_reward_credit: str = "per_turn"
    """'gae' only: which tokens rewards are credited to: 'per_turn' (each turn's reward to the last token the policy
    sampled by the end of that turn) or 'episode_end' (the episode's total reward to its last sampled token)."""
    turn_lambda: float = bounded(1.0, ge=0, le=1)
    """'turn_rloo' only: λ across turns. 1: each turn's tokens get the rewards of that turn and all later turns
    against the others' from the same turn on (unbiased); 0: the turn's own reward against the others' reward for
    that turn (no later reward reaches it; for tasks whose turns do not change each other's rewards)."""
    grpo_normalize_std: bool = True
    """GRPO only: divide the mean-centred rewards by the group's std (False gives Dr.GRPO's advantages)."""
    reinforce_baseline_decay: float = bounded(0.9, ge=0, lt=1)
    """REINFORCE only: the baseline is an exponential moving average of group mean rewards with this decay, in
    [0, 1) (0: the previous group's mean)."""
    drop_zero_variance_groups: bool = False
    """Reject groups whose rewards are all equal (they carry no learning signal under group baselines)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: reject (`zero_advantage`) every group whose advantages, as the estimator computed them,
    are all zero, so that no batch holds one and batches fill from new groups instead; the oversampling it costs is
    reported (`replays/{env}/oversampling/...`, `batches/{env}/oversampling/...`). Not with 'gae' (the critic computes
    the advantages on the learner)."""
    persist_flush_rows: int = bounded(1024, ge=1)
    """Rollouts are written to Parquet in files of at most this many rows (when a rollout directory is set)."""
    persist_flush_interval_s: float = bounded(30.0, gt=0)
    """...or at least this often while rollouts arrive (and at every `flush`, e.g. each learner step, and at exit)."""

    def __post_init__(self):
        try:
            get_estimator(self.advantage_estimator)
        except ValueError as e:
            raise ValueError(f"replay.advantage_estimator: {e}") from None
        if self.gae_reward_credit not in REWARD_CREDITS:
            raise ValueError(
                f"replay.gae_reward_credit must be one of {REWARD_CREDITS}, got {self.gae_reward_credit!r}"
            )
        if self.dynamic_sampling and self.advantage_estimator == "gae":
            raise ValueError(
                "replay.dynamic_sampling drops groups whose advantages are all zero, but with advantage_estimator "
                "'gae' the learner's critic computes the advantages: use a group estimator, or turn it off"
            )
        check_fields(self, "replay")

    def check_fits(
        self, *, max_staleness: tuple[str, int], group_sizes: dict[str, int], prefix: str = "replay"
    ) -> None:
        """Raise ValueError (one line naming the fields) unless these rules can train what generation produces:
        `max_age` >= the staleness gate's bound (`max_staleness`: the field's name and value), else the batcher drops
        data the gate lets generation produce; and `min_group_size` <= every group size (`group_sizes`: field name
        -> value), else every group is rejected. `prefix`: how the caller names this section."""
        name, bound = max_staleness
        if self.max_age < bound:
            raise ValueError(
                f"{prefix}.max_age: must be >= {name} ({bound}), got {self.max_age}: the batcher would drop data the "
                "staleness gate lets generation produce"
            )
        for name, size in group_sizes.items():
            if size < self.min_group_size:
                raise ValueError(
                    f"{name}={size} < {prefix}.min_group_size={self.min_group_size}: every group would be rejected"
                )


def group_sampled_tokens(group: RolloutGroup) -> int:
    """Tokens the policy sampled in `group`."""
    return sum(r.num_sampled_tokens for r in group.rollouts)


def _token_advantages(group: RolloutGroup, scores: GroupScores) -> list[np.ndarray | None]:
    """Per rollout of `group`, its per-token advantages, or None (its advantage on every sampled token)."""
    if scores.token_advantages is None:
        return [None] * len(group.rollouts)
    return list(scores.token_advantages)


def _newest_version(rollout: Rollout) -> int:
    """Newest policy version among the rollout's sampled turns (-1 if none was sampled)."""
    vs = [
        max(t.inference_metadata.version_start, t.inference_metadata.version_end)
        for t in rollout.turns
        if t.is_sampled and t.inference_metadata
    ]
    return max(vs) if vs else -1


def _all_zero_advantages(scores: GroupScores) -> bool:
    """Whether every advantage of a scored group is zero (the per-token ones too, when it has them)."""
    if np.any(scores.advantages != 0):
        return False
    return scores.token_advantages is None or not any(np.any(ta != 0) for ta in scores.token_advantages)


ZERO_ADVANTAGE = "zero_advantage"
"""Rejection reason of a group whose advantages are all zero, under `dynamic_sampling`."""


def too_old(oldest_version: int, learner_version: int | None, max_age: int) -> bool:
    """The staleness rule of what may be trained, in one place: a rollout whose oldest sampled token lags more than
    `max_age` versions behind `learner_version` (None: no version known yet, nothing is too old). When a group may
    *start* is the staleness gate's (`marin_rl.rollouts.staleness`), which keeps such rollouts rare."""
    return learner_version is not None and oldest_version < learner_version - max_age


@dataclass(frozen=True)
class BatchDraw:
    """What the rollouts of one batch cost: groups and tokens sampled since the previous batch, and trained in it."""

    sampled_groups: int
    """Groups that arrived (accepted or rejected) since the previous batch."""
    sampled_tokens: int
    """Tokens the policy sampled in them."""
    trained_groups: int
    """Groups trained for the first time in this batch."""
    trained_tokens: int
    """Sampled tokens of the rollouts this batch trains on."""

    def metrics(self, prefix: str) -> dict[str, float]:
        """The counts and their ratios (sampled / trained; 0 when nothing was trained) under `prefix`."""
        return _draw_metrics(prefix, self.sampled_groups, self.sampled_tokens, self.trained_groups, self.trained_tokens)


def _draw_metrics(prefix: str, sampled_groups: int, sampled_tokens: int, trained_groups: int, trained_tokens: int):
    return {
        f"{prefix}/sampled_groups": sampled_groups,
        f"{prefix}/sampled_tokens": sampled_tokens,
        f"{prefix}/trained_groups": trained_groups,
        f"{prefix}/trained_tokens": trained_tokens,
        f"{prefix}/oversampling/groups": sampled_groups / trained_groups if trained_groups else 0.0,
        f"{prefix}/oversampling/tokens": sampled_tokens / trained_tokens if trained_tokens else 0.0,
    }


@dataclass
class ReplayItem:
    """A rollout waiting in the buffer, with its advantage."""

    rollout: Rollout
    """The rollout (token ids, logprobs, versions)."""
    advantage: float
    """Advantage of the rollout within its group (with per-token advantages: their mean over its sampled tokens)."""
    group_id: str
    """Group it was sampled in."""
    added_at: float
    """Unix time it was accepted."""
    num_tokens: int
    """Tokens it occupies in a batch (after truncation, when `max_len` is set)."""
    oldest_version: int
    """Oldest policy version among its sampled tokens."""
    uses: int = 0
    """Batches it has appeared in."""
    max_len: int | None = None
    """Truncated on admission (`too_long: truncate`): only the first `max_len` tokens are trained on."""
    reward_credit: str | None = None
    """'per_turn' or 'episode_end': the sequence carries per-token rewards for a critic (GAE); None: only the
    group advantage."""
    token_advantages: np.ndarray | None = None
    """Advantage of each token (aligned with the rollout's tokens; 'turn_rloo'), or None: `advantage` on every
    sampled token."""

    def sequence(self) -> Sequence:
        """The tokens and per-token training fields that go into a batch."""
        seq = Sequence.from_rollout(self.rollout, self.advantage, self.reward_credit, self.token_advantages)
        return seq if self.max_len is None else seq.truncated(self.max_len)

    @property
    def sampled_tokens(self) -> int:
        """Tokens the policy sampled that a batch trains on (those that survive truncation)."""
        if self.max_len is None:
            return self.rollout.num_sampled_tokens
        return int(self.rollout.loss_mask()[: self.max_len].sum())


def item_sequences(items: list[ReplayItem]) -> list[Sequence]:
    """`ReplayItem.sequence()` of each item, built together: one conversion per field for all of them
    (`Sequence.from_rollouts`), then each cut to its `max_len`."""
    seqs = Sequence.from_rollouts(
        [it.rollout for it in items],
        [it.advantage for it in items],
        [it.reward_credit for it in items],
        [it.token_advantages for it in items],
    )
    return [s if it.max_len is None else s.truncated(it.max_len) for s, it in zip(seqs, items, strict=True)]


FUTURE_VERSION = "future_version"
"""Rejection reason of a group sampled by a policy version newer than the learner's (see `ReplayBuffer.admit`)."""
TOO_LONG_POLICIES = ("drop", "truncate")
REWARD_CREDITS = ("per_turn", "episode_end")


@dataclass(frozen=True)
class Admission:
    """What `ReplayBuffer.admit` did with a group."""

    accepted: bool
    """Whether the group passed validation and the group filters (its rollouts were scored and persisted)."""
    reason: str | None = None
    """Rejection reason code (counted under `replays/{env}/rejected/{reason}`); None when accepted."""
    detail: str = ""
    """What was wrong, for the log."""
    sampled_tokens: int = 0
    """Tokens the policy sampled in the group (also for a rejected group that could be read)."""
    queued: int = 0
    """Rollouts queued for batches."""
    discarded_stale: int = 0
    """Accepted rollouts discarded on arrival because they were already older than `max_age`."""
    dropped_too_long: int = 0
    """Accepted rollouts dropped because they do not fit a batch row (`too_long: drop`, or nothing sampled would
    survive truncation)."""
    truncated_too_long: int = 0
    """Accepted rollouts queued truncated to a batch row (`too_long: truncate`)."""
    rewards: tuple[float, ...] = ()
    """The group's rollout rewards when it was read and came from the learner's versions (accepted, or rejected by
    the group filters or the estimator); empty otherwise. A pass-rate problem sampler learns from them."""

    @property
    def sampled_by_future_version(self) -> bool:
        """Rejected as sampled by weights newer than the learner's: its problem should be sampled again."""
        return self.reason == FUTURE_VERSION


class ReplayBuffer:
    """Holds one environment's scored rollouts until the batcher takes them.

    `rollout_dir` (local path or fsspec URL) turns on persistence: every accepted rollout is appended to Parquet
    files there (see `marin_rl.replay.store`). `max_tokens` (the batch row length) and `too_long` decide what
    happens to a rollout that does not fit a row: 'drop' it, or 'truncate' it to `max_tokens` (the loss stays on the
    sampled tokens that survive; dropped when none does). Both are counted.
    """

    def __init__(
        self,
        env_name: str,
        config: ReplayConfig,
        vocab_size: int | None = None,
        rollout_dir: str | None = None,
        max_tokens: int | None = None,
        too_long: str = "drop",
    ):
        if too_long not in TOO_LONG_POLICIES:
            raise ValueError(f"too_long must be one of {TOO_LONG_POLICIES}, got {too_long!r}")
        self.env_name = env_name
        self.config = config
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self.too_long = too_long
        self.advantages = GroupAdvantages(
            config.advantage_estimator,
            grpo_normalize_std=config.grpo_normalize_std,
            baseline_decay=config.reinforce_baseline_decay,
            turn_lambda=config.turn_lambda,
            reward_credit=config.gae_reward_credit,
        )
        self.items: list[ReplayItem] = []  # oldest arrival first
        self.learner_version: int | None = None  # latest version given to `drop_stale`
        self.rejected: Counter[str] = Counter()
        self.accepted_groups = 0
        self.discarded_stale = 0
        self.evicted = 0
        self.dropped: Counter[str] = Counter()  # rollouts removed unused, by reason (e.g. too_long)
        self.truncated_too_long = 0
        self.sampled_groups = 0
        self.sampled_tokens = 0
        self.trained_groups = 0
        self.trained_tokens = 0
        self._draw_groups = 0  # groups and tokens sampled since the last `consume`
        self._draw_tokens = 0
        self._trained_group_ids: set[str] = set()  # groups already trained that still have rollouts waiting
        self.segment: int | None = None
        """The run segment whose groups this buffer accepts (`begin_segment`; saved in checkpoints); None: none was
        begun (rows then carry no segment)."""
        self.writer: RolloutWriter | None = None
        if rollout_dir is not None:
            self.writer = RolloutWriter(
                rollout_dir, flush_rows=config.persist_flush_rows, flush_interval_s=config.persist_flush_interval_s
            )
            weakref.finalize(self, self.writer.close)
        self.start_window()

    def start_window(self) -> None:
        """Start a new metrics window: the `new_*` and reward figures of `metrics()` cover groups admitted from now."""
        self._new_rollouts = 0
        self._new_tokens = 0
        self._new_generated = 0
        self._new_rewards: list[float] = []
        self._new_truncated = 0
        self._new_named: dict[str, list[float]] = {}

    # ---- intake -------------------------------------------------------------------------------------
    def admit(self, group: RolloutGroup | dict, max_version: int | None = None) -> Admission:
        """Validate, score, persist and queue a group (module docstring); returns what was done.

        Rejections are logged with their reason and counted; rollouts already older than `max_age` (relative to
        the latest learner version this buffer has seen) are accepted and persisted but discarded (and counted).
        `max_version` (the learner's current version): a group with a token sampled by a newer policy version is
        rejected as `future_version`.
        """
        admission = self._admit(group, max_version)
        self.sampled_groups += 1
        self.sampled_tokens += admission.sampled_tokens
        self._draw_groups += 1
        self._draw_tokens += admission.sampled_tokens
        return admission

    def _admit(self, group: RolloutGroup | dict, max_version: int | None) -> Admission:
        checked = self.validate(group, max_version)
        if isinstance(checked, Admission):
            return checked
        rewards = tuple(float(r) for r in checked.rewards)
        scores = self.score(checked)
        if scores.rejected:
            return self._reject(str(scores.reason), scores.detail, group_sampled_tokens(checked), rewards)
        if self.config.dynamic_sampling and scores.reward_credit is None and _all_zero_advantages(scores):
            detail = f"group {checked.group_id}: every advantage is 0 (rewards {checked.rewards.tolist()})"
            # dynamic sampling's normal path: counted, not warned about one group at a time
            return self._reject(ZERO_ADVANTAGE, detail, group_sampled_tokens(checked), rewards, level=logging.DEBUG)
        now = time.time()
        self.accepted_groups += 1
        self.persist(checked, scores, now)
        return dataclasses.replace(self.enqueue(checked, scores, now), rewards=rewards)

    def validate(self, group: RolloutGroup | dict, max_version: int | None = None) -> RolloutGroup | Admission:
        """Step 1: the group (a `RolloutGroup`, parsed from a dict if need be) when it may be scored, else its
        rejection, counted and logged: `check_group`'s reasons, `future_version` (a token sampled by a version newer
        than `max_version`), `group_too_small` (`min_group_size`), `zero_variance` (`drop_zero_variance_groups`)."""
        try:
            if isinstance(group, dict):
                try:
                    group = RolloutGroup.from_dict(group, validate=False)  # validated once, below
                except RolloutFormatError as e:
                    raise GroupRejected(e.reason, str(e)) from e
            check_group(group, self.env_name, self.vocab_size)
        except GroupRejected as e:
            sampled = group_sampled_tokens(group) if isinstance(group, RolloutGroup) else 0
            return self._reject(e.reason, e.detail, sampled)
        if max_version is not None:
            newest = max(_newest_version(r) for r in group.rollouts)
            if newest > max_version:
                return self._reject(
                    FUTURE_VERSION,
                    f"group {group.group_id} was sampled by policy version {newest}, newer than the learner's "
                    f"{max_version} (left over from before a restore)",
                    group_sampled_tokens(group),
                )
        rewards = group.rewards
        read = tuple(float(r) for r in rewards)
        if len(group.rollouts) < self.config.min_group_size:
            return self._reject(
                "group_too_small",
                f"{len(group.rollouts)} < {self.config.min_group_size}",
                group_sampled_tokens(group),
                read,
            )
        if self.config.drop_zero_variance_groups and np.all(rewards == rewards[0]):
            return self._reject(
                "zero_variance", f"all rewards {rewards[0]}", group_sampled_tokens(group), read, level=logging.DEBUG
            )
        return group

    def score(self, group: RolloutGroup) -> GroupScores:
        """Step 2: the configured estimator's scores of a valid group: an advantage per rollout (and per token for
        e.g. 'turn_rloo'), or the estimator's rejection (e.g. 'remax' without the greedy reward:
        `no_greedy_baseline`). Stateful estimators (REINFORCE's baseline) update their state here."""
        return self.advantages.score(group)

    def persist(self, group: RolloutGroup, scores: GroupScores, now: float) -> None:
        """Step 3: append the scored rollouts to Parquet (when the buffer has a `rollout_dir`), with the segment and
        the group's place among the accepted groups (`accepted_groups`, which already counts it)."""
        if self.writer is None:
            return
        self.writer.append_rollouts(
            group.rollouts,
            group.group_id,
            scores.advantages,
            now,
            _token_advantages(group, scores),
            self.segment,
            self.accepted_groups,
        )

    # ---- run segments ---------------------------------------------------------------------------------
    def recorded_segments(self) -> list[int]:
        """The segments recorded in the rollout directory's timeline (empty without one, or without a directory)."""
        if self.writer is None:
            return []
        return [s["segment"] for s in read_timeline(self.writer.directory)]

    def begin_segment(self, segment: int, step: int) -> None:
        """From now on, accepted groups belong to run segment `segment`, which starts at learner step `step` from this
        buffer's current state (fresh, or loaded from a checkpoint or the start of the run): its parent is the
        segment that state belongs to, and its groups are numbered after the `accepted_groups` of that state.
        Recorded in the rollout directory's timeline before any of its rows is written."""
        if self.writer is not None:
            record_segment(self.writer.directory, segment, self.segment, step, self.accepted_groups)
        self.segment = segment

    def enqueue(self, group: RolloutGroup, scores: GroupScores, now: float) -> Admission:
        """Step 4: queue the scored rollouts for batches, except those already older than `max_age` (discarded), those
        an environment marked untrainable (`DROP_REASON`: dropped, counted by reason) and those longer than
        `max_tokens` (`too_long`: dropped, or truncated when something sampled survives the cut); then
        evict the oldest arrivals past `capacity`. Counts and logs each, and returns the `Admission`."""
        stale = too_long = truncated = queued = 0
        token_advantages = _token_advantages(group, scores)
        for r, a, ta in zip(group.rollouts, scores.advantages, token_advantages, strict=True):
            self._count_new(r)
            if too_old(r.oldest_version, self.learner_version, self.config.max_age):
                stale += 1
                continue
            marked = r.metadata.get(DROP_REASON)
            if marked:
                self.dropped[str(marked)] += 1  # the environment marked its tokens as untrainable
                continue
            item = ReplayItem(
                rollout=r,
                advantage=float(a),
                group_id=group.group_id,
                added_at=now,
                num_tokens=r.num_tokens,
                oldest_version=r.oldest_version,
                reward_credit=scores.reward_credit,
                token_advantages=None if ta is None else ta.astype(np.float32),
            )
            if self.max_tokens is not None and r.num_tokens > self.max_tokens:
                if self.too_long == "drop" or not r.loss_mask()[: self.max_tokens].any():
                    too_long += 1  # nothing sampled would survive the cut: nothing to train on
                    continue
                item.max_len = item.num_tokens = self.max_tokens
                truncated += 1
            self.items.append(item)
            queued += 1
        self.discarded_stale += stale
        self.dropped["too_long"] += too_long
        self.truncated_too_long += truncated
        if stale:
            logger.info(
                "replay[%s]: %d rollouts arrived older than max_age=%d (learner at %s); discarded",
                self.env_name,
                stale,
                self.config.max_age,
                self.learner_version,
            )
        if too_long or truncated:
            logger.info(
                "replay[%s]: %d rollouts longer than %d tokens dropped, %d truncated",
                self.env_name,
                too_long,
                self.max_tokens,
                truncated,
            )
        overflow = len(self.items) - self.config.capacity
        if overflow > 0:
            del self.items[:overflow]
            self.evicted += overflow
            logger.info(
                "replay[%s]: over capacity %d, evicted the %d oldest", self.env_name, self.config.capacity, overflow
            )
        return Admission(
            accepted=True,
            sampled_tokens=group_sampled_tokens(group),
            queued=queued,
            discarded_stale=stale,
            dropped_too_long=too_long,
            truncated_too_long=truncated,
        )

    def _count_new(self, r: Rollout) -> None:
        self._new_rollouts += 1
        self._new_tokens += r.num_tokens
        self._new_generated += r.num_sampled_tokens
        self._new_rewards.append(r.reward)
        self._new_truncated += int(r.truncated)
        for turn in r.turns:
            for name, value in turn.rewards.items():
                self._new_named.setdefault(name, []).append(value)

    def _reject(
        self,
        reason: str,
        detail: str,
        sampled_tokens: int,
        rewards: tuple[float, ...] = (),
        level: int = logging.WARNING,
    ) -> Admission:
        self.rejected[reason] += 1
        logger.log(level, "replay[%s]: rejected a group (%s): %s", self.env_name, reason, detail)
        return Admission(accepted=False, reason=reason, detail=detail, sampled_tokens=sampled_tokens, rewards=rewards)

    # ---- staleness and selection ----------------------------------------------------------------------
    def drop_stale(self, learner_version: int) -> int:
        """Discard rollouts older than `max_age` learner steps; returns how many were dropped."""
        self.learner_version = learner_version
        keep = [it for it in self.items if not too_old(it.oldest_version, learner_version, self.config.max_age)]
        dropped = len(self.items) - len(keep)
        if dropped:
            self.items = keep
            self.discarded_stale += dropped
            logger.info("replay[%s]: discarded %d rollouts older than max_age", self.env_name, dropped)
        return dropped

    def newest_first(self) -> list[ReplayItem]:
        """The waiting rollouts, most recent arrival first."""
        return list(reversed(self.items))

    def consume(self, used: list[ReplayItem]) -> BatchDraw:
        """Count a use of each item (the rollouts one batch takes from this buffer); items that reached `max_reuse`
        leave the buffer. Returns the batch's `BatchDraw` and starts the next one's count."""
        new_groups = {it.group_id for it in used} - self._trained_group_ids
        tokens = sum(it.sampled_tokens for it in used)
        for it in used:
            it.uses += 1
        if used:
            self.items = [it for it in self.items if it.uses < self.config.max_reuse]
        waiting = {it.group_id for it in self.items}
        self._trained_group_ids = (self._trained_group_ids | new_groups) & waiting
        self.trained_groups += len(new_groups)
        self.trained_tokens += tokens
        draw = BatchDraw(self._draw_groups, self._draw_tokens, len(new_groups), tokens)
        self._draw_groups = self._draw_tokens = 0
        return draw

    def flush(self) -> None:
        """Write rollouts queued for persistence."""
        if self.writer is not None:
            self.writer.flush()

    @property
    def num_tokens(self) -> int:
        """Tokens waiting in the buffer (as they would occupy a batch)."""
        return sum(it.num_tokens for it in self.items)

    def __len__(self) -> int:
        return len(self.items)

    # ---- checkpoint state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The waiting rollouts (as `Rollout.to_dict`), counters and estimator state, JSON-compatible.

        The metrics window (`new_*`, reward figures since the last `start_window`) is not included.
        """
        state = {
            "env_name": self.env_name,
            "items": [
                {
                    "rollout": it.rollout.to_dict(),
                    "advantage": it.advantage,
                    "group_id": it.group_id,
                    "added_at": it.added_at,
                    "num_tokens": it.num_tokens,
                    "oldest_version": it.oldest_version,
                    "uses": it.uses,
                    "max_len": it.max_len,
                    "reward_credit": it.reward_credit,
                    "token_advantages": None if it.token_advantages is None else it.token_advantages.tolist(),
                }
                for it in self.items
            ],
            "learner_version": self.learner_version,
            "rejected": dict(self.rejected),
            "accepted_groups": self.accepted_groups,
            "discarded_stale": self.discarded_stale,
            "evicted": self.evicted,
            "dropped": dict(self.dropped),
            "truncated_too_long": self.truncated_too_long,
            "segment": self.segment,
            "sampling": {
                "sampled_groups": self.sampled_groups,
                "sampled_tokens": self.sampled_tokens,
                "trained_groups": self.trained_groups,
                "trained_tokens": self.trained_tokens,
                "draw_groups": self._draw_groups,
                "draw_tokens": self._draw_tokens,
                "trained_group_ids": sorted(self._trained_group_ids),
            },
        }
        estimator_state = self.advantages.state_dict()  # e.g. 'reinforce_baseline'
        clash = sorted(estimator_state.keys() & state.keys())
        if clash:
            raise ValueError(
                f"advantage estimator {self.advantages.name!r}: state keys {clash} clash with the buffer's"
            )
        return {**state, **estimator_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output (rollouts are validated again; nothing is persisted a second time)."""
        if state["env_name"] != self.env_name:
            raise ValueError(f"replay state of env {state['env_name']!r} loaded into the buffer of {self.env_name!r}")
        self.items = [
            ReplayItem(
                rollout=Rollout.from_dict(d["rollout"], validate=False),
                advantage=float(d["advantage"]),
                group_id=str(d["group_id"]),
                added_at=float(d["added_at"]),
                num_tokens=int(d["num_tokens"]),
                oldest_version=int(d["oldest_version"]),
                uses=int(d["uses"]),
                max_len=None if d["max_len"] is None else int(d["max_len"]),
                reward_credit=d.get("reward_credit"),
                token_advantages=None
                if d.get("token_advantages") is None
                else np.asarray(d["token_advantages"], np.float32),
            )
            for d in state["items"]
        ]
        lv = state["learner_version"]
        self.learner_version = None if lv is None else int(lv)
        self.rejected = Counter({str(k): int(v) for k, v in state["rejected"].items()})
        self.accepted_groups = int(state["accepted_groups"])
        self.discarded_stale = int(state["discarded_stale"])
        self.evicted = int(state["evicted"])
        self.dropped = Counter({str(k): int(v) for k, v in state["dropped"].items()})
        self.truncated_too_long = int(state.get("truncated_too_long", 0))
        self.segment = None if state.get("segment") is None else int(state["segment"])
        sampling = state.get("sampling", {})  # absent from checkpoints written before it was counted
        self.sampled_groups = int(sampling.get("sampled_groups", 0))
        self.sampled_tokens = int(sampling.get("sampled_tokens", 0))
        self.trained_groups = int(sampling.get("trained_groups", 0))
        self.trained_tokens = int(sampling.get("trained_tokens", 0))
        self._draw_groups = int(sampling.get("draw_groups", 0))
        self._draw_tokens = int(sampling.get("draw_tokens", 0))
        self._trained_group_ids = {str(g) for g in sampling.get("trained_group_ids", [])}
        self.advantages.load_state_dict(state)
        self.start_window()

    # ---- metrics ----------------------------------------------------------------------------------------
    def metrics(self, learner_version: int) -> dict[str, float]:
        """`replays/{env}/...` metrics (a read: nothing changes); the `new_*` and reward figures cover the groups
        admitted since the last `start_window()`."""
        p = f"replays/{self.env_name}"
        on_policy = sum(1 for it in self.items if it.oldest_version >= learner_version)
        out: dict[str, float] = {
            f"{p}/rollouts_in_buffer": len(self.items),
            f"{p}/tokens_in_buffer": self.num_tokens,
            f"{p}/frac_on_policy": on_policy / len(self.items) if self.items else 0.0,
            f"{p}/new_rollouts": self._new_rollouts,
            f"{p}/new_tokens": self._new_tokens,
            f"{p}/new_generated_tokens": self._new_generated,
            f"{p}/accepted_groups": self.accepted_groups,
            f"{p}/discarded_stale": self.discarded_stale,
            f"{p}/evicted": self.evicted,
            f"{p}/truncated_too_long": self.truncated_too_long,
            f"{p}/rejected": sum(self.rejected.values()),
            **_draw_metrics(p, self.sampled_groups, self.sampled_tokens, self.trained_groups, self.trained_tokens),
        }
        for reason, n in self.rejected.items():
            out[f"{p}/rejected/{reason}"] = n
        for reason, n in self.dropped.items():
            out[f"{p}/dropped/{reason}"] = n
        for name, value in self.advantages.metrics().items():  # e.g. REINFORCE's baseline
            out[f"{p}/{name}"] = value
        if self._new_rewards:
            r = np.asarray(self._new_rewards)
            out[f"{p}/reward/mean"] = float(r.mean())
            out[f"{p}/reward/std"] = float(r.std())
            out[f"{p}/frac_truncated"] = self._new_truncated / len(r)
            for name, vals in self._new_named.items():
                out[f"{p}/rewards/{name}/mean"] = float(np.mean(vals))
                out[f"{p}/rewards/{name}/std"] = float(np.std(vals))
        return out
