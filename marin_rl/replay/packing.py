"""Packing whole sequences into fixed-size rows (several per row, separated by segment ids).

Row assignment is bin packing with a fixed number of bins: `pack_rows` runs first-fit-decreasing and
best-fit-decreasing and keeps whichever places more tokens (ties: fewer rows used), so it is never worse than FFD.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np

from marin_rl.replay.gae import token_rewards
from marin_rl.types import SEQUENCE_FIELDS, TOKEN_FIELDS, PackedBatch, Rollout, TokenField, check_token_fields


@dataclass
class Sequence:
    """One sequence to pack: a rollout's tokens with per-token training fields (`SEQUENCE_FIELDS`: dtypes, padding and
    meaning are declared in `marin_rl.types.TOKEN_FIELDS`)."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    sampler_logprobs: np.ndarray
    token_versions: np.ndarray
    rewards: np.ndarray | None = None
    episode_truncated: bool = False
    """The episode was cut off by a length limit (GAE bootstraps its last step)."""
    teacher_logprobs: np.ndarray | None = None
    teacher_top_ids: np.ndarray | None = None
    teacher_top_logprobs: np.ndarray | None = None
    routed_experts: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    def per_token(self) -> dict[str, np.ndarray | None]:
        """The declared per-token fields (`SEQUENCE_FIELDS`) by name; None for an absent optional one."""
        return {f.name: getattr(self, f.name) for f in SEQUENCE_FIELDS}

    @staticmethod
    def of(token_ids: Any, episode_truncated: bool = False, **fields: Any) -> Sequence:
        """A sequence with each per-token field as an array of its declared dtype (None stays None)."""
        unknown = set(fields) - {f.name for f in SEQUENCE_FIELDS}
        if unknown:
            raise TypeError(f"not per-token fields of a sequence: {sorted(unknown)}")
        typed = {
            f.name: None if fields.get(f.name) is None else np.asarray(fields[f.name], f.dtype) for f in SEQUENCE_FIELDS
        }
        return Sequence(np.asarray(token_ids, np.int32), episode_truncated=episode_truncated, **typed)

    @staticmethod
    def from_rollout(
        rollout: Rollout,
        advantage: float,
        reward_credit: str | None = None,
        token_advantages: np.ndarray | None = None,
    ) -> Sequence:
        """The rollout's token sequence; the advantage is spread over its sampled tokens, or `token_advantages` (one
        per token) are used as they are on them. `reward_credit` ('per_turn' or 'episode_end', see `token_rewards`)
        also gives it per-token rewards for a critic."""
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        sampled: list[bool] = []
        lengths: list[int] = []
        _collect_turns(rollout, ids, logprobs, versions, sampled, lengths)  # each field is converted once, below
        mask = np.repeat(np.asarray(sampled, bool), lengths)
        if token_advantages is not None and len(token_advantages) != len(mask):
            raise ValueError(f"token_advantages has {len(token_advantages)} entries for {len(mask)} tokens")
        per_token = np.float32(advantage) if token_advantages is None else np.asarray(token_advantages, np.float32)
        top_ids = top_lps = None
        teacher = rollout.has_teacher_logprobs
        if teacher and rollout.teacher_top_k:
            top_ids, top_lps = rollout.teacher_top(rollout.teacher_top_k)
        return Sequence.of(
            ids,
            episode_truncated=rollout.truncated,
            loss_mask=mask,
            advantages=np.where(mask, per_token, np.float32(0.0)),
            sampler_logprobs=np.asarray(logprobs, np.float32),
            token_versions=np.asarray(versions, np.int32),
            rewards=None if reward_credit is None else token_rewards(rollout, per_turn=reward_credit == "per_turn"),
            teacher_logprobs=rollout.teacher_logprobs() if teacher else None,
            teacher_top_ids=top_ids,
            teacher_top_logprobs=top_lps,
            routed_experts=rollout.routed_experts(),
        )

    @staticmethod
    def from_rollouts(
        rollouts: list[Rollout],
        advantages: list[float],
        reward_credits: list[str | None] | None = None,
        token_advantages: list[np.ndarray | None] | None = None,
    ) -> list[Sequence]:
        """`from_rollout` of each rollout (same arguments, one per rollout; None for all: none), in one pass over all
        their turns and one conversion per field for all of them; the sequences are views of the batch-wide arrays.
        Rollouts with per-token rewards, a teacher's logprobs or routed experts go through `from_rollout` one by one."""
        n = len(rollouts)
        credits = reward_credits or [None] * n
        token_adv = token_advantages or [None] * n
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        sampled: list[bool] = []
        turn_lengths: list[int] = []
        lengths: list[int] = []
        truncated: list[bool] = []
        plain: list[int] = []  # the rollouts converted together
        for i, r in enumerate(rollouts):
            if credits[i] is not None or any(
                t.teacher_logprobs is not None or t.routed_experts is not None for t in r.turns
            ):
                continue
            plain.append(i)
            before = len(ids)
            _collect_turns(r, ids, logprobs, versions, sampled, turn_lengths)
            lengths.append(len(ids) - before)
            truncated.append(r.truncated)
        out: list = [None] * n  # Sequence for each rollout
        if plain:
            mask = np.repeat(np.asarray(sampled, bool), turn_lengths)
            for i, k in zip(plain, lengths, strict=True):
                if token_adv[i] is not None and len(token_adv[i]) != k:
                    raise ValueError(f"token_advantages has {len(token_adv[i])} entries for {k} tokens")
            if any(token_adv[i] is not None for i in plain):
                per_token = np.concatenate(
                    [
                        np.full(k, np.float32(advantages[i]), np.float32)
                        if token_adv[i] is None
                        else np.asarray(token_adv[i], np.float32)
                        for i, k in zip(plain, lengths, strict=True)
                    ]
                )
            else:
                per_token = np.repeat(np.asarray([advantages[i] for i in plain], np.float32), lengths)
            cuts = np.cumsum(lengths)[:-1]
            columns = zip(
                np.split(np.asarray(ids, np.int32), cuts),
                np.split(mask, cuts),
                np.split(np.where(mask, per_token, np.float32(0.0)), cuts),
                np.split(np.asarray(logprobs, np.float32), cuts),
                np.split(np.asarray(versions, np.int32), cuts),
                strict=True,
            )
            for i, cut, (tok, m, adv, lp, ver) in zip(plain, truncated, columns, strict=True):
                out[i] = Sequence(
                    token_ids=tok,
                    loss_mask=m,
                    advantages=adv,
                    sampler_logprobs=lp,
                    token_versions=ver,
                    episode_truncated=cut,
                )
        for i, r in enumerate(rollouts):
            if out[i] is None:
                out[i] = Sequence.from_rollout(r, advantages[i], credits[i], token_adv[i])
        return out

    def truncated(self, max_len: int) -> Sequence:
        """The first `max_len` tokens of every per-token field (loss stays only on the sampled tokens that survive); a
        sequence that loses tokens counts as truncated (rewards after the cut are dropped: the critic's value stands in
        for them)."""
        return Sequence(
            self.token_ids[:max_len],
            episode_truncated=self.episode_truncated or len(self) > max_len,
            **{name: None if v is None else v[:max_len] for name, v in self.per_token().items()},
        )

    @staticmethod
    def supervised(prompt_ids: list[int], completion_ids: list[int]) -> Sequence:
        """A prompt/completion pair for supervised training (loss on the completion)."""
        n_p, n_c = len(prompt_ids), len(completion_ids)
        return Sequence.of(
            list(prompt_ids) + list(completion_ids),
            loss_mask=np.r_[np.zeros(n_p, bool), np.ones(n_c, bool)],
            advantages=np.zeros(n_p + n_c),
            sampler_logprobs=np.zeros(n_p + n_c),
            token_versions=np.full(n_p + n_c, -1),
        )


check_token_fields(Sequence, SEQUENCE_FIELDS)


def _collect_turns(rollout: Rollout, ids: list, logprobs: list, versions: list, sampled: list, lengths: list) -> None:
    """Append `rollout`'s per-token values to the lists, in one pass over its turns: token ids, sampler logprobs (0
    where not sampled), token versions (-1 where not sampled; the turn's `version_start` where it has no per-token
    versions), and per turn whether it was sampled and its length."""
    for t in rollout.turns:
        n = len(t.token_ids)
        ids += t.token_ids
        lengths.append(n)
        sampled.append(t.sampler_logprobs is not None)
        meta = t.inference_metadata
        if t.sampler_logprobs is None:
            logprobs += [0.0] * n
            versions += [-1] * n
        else:
            logprobs += t.sampler_logprobs
            if meta is not None and meta.token_versions is not None:
                versions += meta.token_versions
            else:
                versions += [-1 if meta is None else meta.version_start] * n


def first_fit_decreasing(lengths: list[int], num_rows: int, row_len: int) -> list[int | None]:
    """Row assigned to each sequence (None if it fits nowhere), longest sequences placed first."""
    free = [row_len] * num_rows
    assignment: list[int | None] = [None] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        for r in range(num_rows):
            if free[r] >= n:
                free[r] -= n
                assignment[i] = r
                break
    return assignment


def best_fit_decreasing(lengths: list[int], num_rows: int, row_len: int) -> list[int | None]:
    """Row assigned to each sequence (None if it fits nowhere): longest first, each into the fullest row it fits."""
    free = [(row_len, r) for r in range(num_rows)]  # sorted by free space, then row
    assignment: list[int | None] = [None] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        k = bisect.bisect_left(free, (n, -1))
        if k == len(free):
            continue
        space, r = free.pop(k)
        assignment[i] = r
        bisect.insort(free, (space - n, r))
    return assignment


def _score(lengths: list[int], assignment: list[int | None]) -> tuple[int, int]:
    placed = sum(n for n, r in zip(lengths, assignment, strict=True) if r is not None)
    rows = len({r for r in assignment if r is not None})
    return placed, -rows


def pack_rows(lengths: list[int], num_rows: int, row_len: int) -> list[int | None]:
    """Row of each sequence (None if left out): the better of first-fit- and best-fit-decreasing.

    "Better" is more tokens placed, then fewer rows touched; the result is never worse than FFD.
    """
    ffd = first_fit_decreasing(lengths, num_rows, row_len)
    bfd = best_fit_decreasing(lengths, num_rows, row_len)
    return bfd if _score(lengths, bfd) > _score(lengths, ffd) else ffd


def pack(
    sequences: list[Sequence], num_rows: int, row_len: int, assignment: list[int | None] | None = None
) -> tuple[PackedBatch, list[int]]:
    """Pack sequences into a `(num_rows, row_len)` batch, by `pack_rows` unless `assignment` gives rows.

    Returns the batch and the indices of the sequences that were placed (in input order); the others did not
    fit. Segment ids number the sequences within each row from 0; padding holds each field's declared fill
    (`TOKEN_FIELDS`: segment id -1, no loss). The batch carries an optional field (rewards, teacher logprobs, the
    teacher's top-k) when the placed sequences do (ValueError when only some of them do, or with different k).
    """
    if assignment is None:
        assignment = pack_rows([len(s) for s in sequences], num_rows, row_len)
    placed_seqs = [s for s, row in zip(sequences, assignment, strict=True) if row is not None]
    present = {f.name: _present(f, placed_seqs) for f in SEQUENCE_FIELDS}
    present["truncated"] = present["rewards"]  # the critic's bootstrap flag goes with its rewards
    arrays: dict[str, np.ndarray | None] = {}
    for f in TOKEN_FIELDS:
        if f.optional and not present[f.name]:
            arrays[f.name] = None
            continue
        k = (present[f.name],) if f.top_k else ()
        arrays[f.name] = np.full((num_rows, row_len, *k), f.fill, f.dtype)
    # where each placed sequence lands (a few integers per sequence), then every field is copied in one
    # vectorised assignment over all of them
    fill = [0] * num_rows
    nseg = [0] * num_rows
    placed: list[int] = []
    flat_starts: list[int] = []
    segments: list[int] = []
    for i, (seq, row) in enumerate(zip(sequences, assignment, strict=True)):
        if row is None:
            continue
        a, b = fill[row], fill[row] + len(seq)
        if b > row_len:
            raise ValueError(f"row {row} overflows: sequence {i} needs {len(seq)} tokens, {row_len - a} left")
        flat_starts.append(row * row_len + a)
        segments.append(nseg[row])
        fill[row] = b
        nseg[row] += 1
        placed.append(i)
    if not placed:
        return PackedBatch(**arrays), placed
    lengths = np.fromiter((len(s) for s in placed_seqs), np.int64, len(placed_seqs))
    total = int(lengths.sum())
    seq_start = np.repeat(np.cumsum(lengths) - lengths, lengths)  # where each token's sequence starts, flat
    position = np.arange(total) - seq_start
    dest = np.repeat(np.asarray(flat_starts, np.int64), lengths) + position
    layout = {
        "input_ids": [s.token_ids for s in placed_seqs],
        "position_ids": position,
        "segment_ids": np.repeat(np.asarray(segments, np.int64), lengths),
        "truncated": np.repeat(np.asarray([s.episode_truncated for s in placed_seqs], bool), lengths),
    }
    for f in TOKEN_FIELDS:
        out = arrays[f.name]
        if out is None:
            continue
        values = layout[f.name] if f.layout else [getattr(s, f.name) for s in placed_seqs]
        if isinstance(values, list):
            _check_lengths(f.name, values, lengths)
            values = np.concatenate(values)
        out.reshape(num_rows * row_len, *out.shape[2:])[dest] = values
    return PackedBatch(**arrays), placed


def _check_lengths(name: str, values: list[np.ndarray], lengths: np.ndarray) -> None:
    """ValueError unless each sequence's `name` has one entry per token (`lengths`)."""
    have = np.fromiter((len(v) for v in values), np.int64, len(values))
    if not np.array_equal(have, lengths):
        k = int(np.flatnonzero(have != lengths)[0])
        raise ValueError(f"a packed sequence has {have[k]} {name} for {lengths[k]} tokens")


def _present(f: TokenField, seqs: list[Sequence]) -> bool | int:
    """Whether the placed sequences carry field `f` (its k for a top-k field, 0 when absent): all of them or none,
    and one k a batch (ValueError otherwise)."""
    have = [getattr(s, f.name) is not None for s in seqs]
    if f.top_k:
        ks = {getattr(s, f.name).shape[1] if h else 0 for s, h in zip(seqs, have, strict=True)}
        if len(ks) > 1:
            raise ValueError(f"packed rollouts carry {f.name} for different k {sorted(ks)}: one k a batch")
        return ks.pop() if ks else 0
    if any(have) and not all(have):
        raise ValueError(
            f"{have.count(False)} of {len(have)} packed rollouts have no {f.name.replace('_', ' ')}: a batch carries "
            "it whole or not at all"
        )
    return any(have)
