"""Packing whole sequences into fixed-size rows (several per row, separated by segment ids).

Row assignment is bin packing with a fixed number of bins: `pack_rows` runs first-fit-decreasing and
best-fit-decreasing and keeps whichever places more tokens (ties: fewer rows used), so it is never worse than FFD.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from marin_rl.replay.gae import token_rewards
from marin_rl.types import PackedBatch, Rollout


@dataclass
class Sequence:
    """One sequence to pack: a rollout's tokens with per-token training fields."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    sampler_logprobs: np.ndarray
    token_versions: np.ndarray
    rewards: np.ndarray | None = None
    """Reward credited to each token (GAE batches; see `PackedBatch.rewards`), or None."""
    episode_truncated: bool = False
    """The episode was cut off by a length limit (GAE bootstraps its last step)."""
    teacher_logprobs: np.ndarray | None = None
    """A teacher's logprob of each sampled token (0 elsewhere), or None when no teacher scored the rollout."""
    teacher_top_ids: np.ndarray | None = None
    """Top-k distillation: `[tokens, k]` ids of the teacher's k most likely tokens at each sampled token (0
    elsewhere), or None."""
    teacher_top_logprobs: np.ndarray | None = None
    """The teacher's logprobs of `teacher_top_ids` (`[tokens, k]`), or None."""

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

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
        mask = rollout.loss_mask()
        if token_advantages is not None and len(token_advantages) != len(mask):
            raise ValueError(f"token_advantages has {len(token_advantages)} entries for {len(mask)} tokens")
        per_token = np.float32(advantage) if token_advantages is None else np.asarray(token_advantages, np.float32)
        rewards = None
        top_ids = top_lps = None
        if rollout.has_teacher_logprobs and rollout.teacher_top_k:
            top_ids, top_lps = rollout.teacher_top(rollout.teacher_top_k)
        if reward_credit is not None:
            rewards = token_rewards(rollout, per_turn=reward_credit == "per_turn").astype(np.float32)
        return Sequence(
            token_ids=np.asarray(rollout.token_ids, dtype=np.int32),
            loss_mask=mask,
            advantages=np.where(mask, per_token, np.float32(0.0)),
            sampler_logprobs=rollout.sampler_logprobs(),
            token_versions=rollout.token_versions(),
            rewards=rewards,
            episode_truncated=rollout.truncated,
            teacher_logprobs=rollout.teacher_logprobs() if rollout.has_teacher_logprobs else None,
            teacher_top_ids=top_ids,
            teacher_top_logprobs=top_lps,
        )

    def truncated(self, max_len: int) -> Sequence:
        """The first `max_len` tokens (loss stays only on the sampled tokens that survive); a sequence that loses
        tokens counts as truncated (rewards after the cut are dropped: the critic's value stands in for them)."""
        return Sequence(
            token_ids=self.token_ids[:max_len],
            loss_mask=self.loss_mask[:max_len],
            advantages=self.advantages[:max_len],
            sampler_logprobs=self.sampler_logprobs[:max_len],
            token_versions=self.token_versions[:max_len],
            rewards=None if self.rewards is None else self.rewards[:max_len],
            episode_truncated=self.episode_truncated or len(self) > max_len,
            teacher_logprobs=None if self.teacher_logprobs is None else self.teacher_logprobs[:max_len],
            teacher_top_ids=None if self.teacher_top_ids is None else self.teacher_top_ids[:max_len],
            teacher_top_logprobs=None if self.teacher_top_logprobs is None else self.teacher_top_logprobs[:max_len],
        )

    @staticmethod
    def supervised(prompt_ids: list[int], completion_ids: list[int]) -> Sequence:
        """A prompt/completion pair for supervised training (loss on the completion)."""
        n_p, n_c = len(prompt_ids), len(completion_ids)
        return Sequence(
            token_ids=np.asarray(list(prompt_ids) + list(completion_ids), dtype=np.int32),
            loss_mask=np.r_[np.zeros(n_p, bool), np.ones(n_c, bool)],
            advantages=np.zeros(n_p + n_c, np.float32),
            sampler_logprobs=np.zeros(n_p + n_c, np.float32),
            token_versions=np.full(n_p + n_c, -1, np.int32),
        )


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
    fit. Segment ids number the sequences within each row from 0; padding has segment id -1 and no loss. The batch
    carries teacher logprobs (and the teacher's top-k) when the sequences do (ValueError when only some of them do,
    or with different k).
    """
    if assignment is None:
        assignment = pack_rows([len(s) for s in sequences], num_rows, row_len)
    scored = [s.teacher_logprobs is not None for s, row in zip(sequences, assignment, strict=True) if row is not None]
    with_teacher = any(scored)
    if with_teacher and not all(scored):
        raise ValueError(
            f"{scored.count(False)} of {len(scored)} packed rollouts have no teacher logprobs: a batch is scored "
            "by a teacher whole or not at all"
        )
    teacher_logprobs = np.zeros((num_rows, row_len), np.float32) if with_teacher else None
    placed_seqs = [s for s, row in zip(sequences, assignment, strict=True) if row is not None]
    top_ks = {0 if s.teacher_top_ids is None else s.teacher_top_ids.shape[1] for s in placed_seqs}
    if len(top_ks) > 1:
        raise ValueError(f"packed rollouts carry the teacher's top-k for different k {sorted(top_ks)}: one k a batch")
    top_k = top_ks.pop() if top_ks else 0
    top_ids = np.zeros((num_rows, row_len, top_k), np.int32) if top_k else None
    top_lps = np.zeros((num_rows, row_len, top_k), np.float32) if top_k else None
    input_ids = np.zeros((num_rows, row_len), np.int32)
    position_ids = np.zeros((num_rows, row_len), np.int32)
    segment_ids = np.full((num_rows, row_len), -1, np.int32)
    loss_mask = np.zeros((num_rows, row_len), bool)
    advantages = np.zeros((num_rows, row_len), np.float32)
    sampler_logprobs = np.zeros((num_rows, row_len), np.float32)
    token_versions = np.full((num_rows, row_len), -1, np.int32)
    with_rewards = any(s.rewards is not None for s in sequences)
    rewards = np.zeros((num_rows, row_len), np.float32) if with_rewards else None
    truncated = np.zeros((num_rows, row_len), bool) if with_rewards else None
    fill = [0] * num_rows
    nseg = [0] * num_rows
    placed = []
    for i, (seq, row) in enumerate(zip(sequences, assignment, strict=True)):
        if row is None:
            continue
        a, b = fill[row], fill[row] + len(seq)
        if b > row_len:
            raise ValueError(f"row {row} overflows: sequence {i} needs {len(seq)} tokens, {row_len - a} left")
        input_ids[row, a:b] = seq.token_ids
        position_ids[row, a:b] = np.arange(len(seq))
        segment_ids[row, a:b] = nseg[row]
        loss_mask[row, a:b] = seq.loss_mask
        advantages[row, a:b] = seq.advantages
        sampler_logprobs[row, a:b] = seq.sampler_logprobs
        token_versions[row, a:b] = seq.token_versions
        if with_rewards:
            if seq.rewards is not None:
                rewards[row, a:b] = seq.rewards
            truncated[row, a:b] = seq.episode_truncated
        if with_teacher:
            teacher_logprobs[row, a:b] = seq.teacher_logprobs
        if top_k:
            top_ids[row, a:b] = seq.teacher_top_ids
            top_lps[row, a:b] = seq.teacher_top_logprobs
        fill[row] = b
        nseg[row] += 1
        placed.append(i)
    batch = PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        segment_ids=segment_ids,
        loss_mask=loss_mask,
        advantages=advantages,
        sampler_logprobs=sampler_logprobs,
        token_versions=token_versions,
        rewards=rewards,
        truncated=truncated,
        teacher_logprobs=teacher_logprobs,
        teacher_top_ids=top_ids,
        teacher_top_logprobs=top_lps,
    )
    return batch, placed
