"""The vectorised packing against a reference written token by token: `Sequence.from_rollout` against the rollout's
own per-field views, and `pack` against a placement that copies each sequence into its row one at a time, on random
rollouts (multi-turn, per-token versions, per-token advantages, rewards for a critic, a teacher's top-k)."""

from __future__ import annotations

import numpy as np
import pytest

from marin_rl.replay.gae import token_rewards
from marin_rl.replay.packing import Sequence, pack, pack_rows
from marin_rl.types import SEQUENCE_FIELDS, TOKEN_FIELDS, InferenceMetadata, Rollout, Turn

K = 3


def _random_rollout(rng: np.random.Generator, teacher: bool) -> Rollout:
    turns = [Turn("user", "q", rng.integers(0, 50, int(rng.integers(1, 6))).tolist())]
    for j in range(int(rng.integers(1, 4))):
        n = int(rng.integers(0, 7))
        start = int(rng.integers(0, 5))
        versions = None if rng.random() < 0.5 else sorted(rng.integers(start, start + 2, n).tolist())
        meta = InferenceMetadata(
            server="s",
            version_start=start,
            version_end=start + 1,
            token_versions=versions,
            finish_reason="length" if rng.random() < 0.3 else "stop",
        )
        turn = Turn(
            "assistant",
            "a",
            rng.integers(0, 50, n).tolist(),
            sampler_logprobs=(-rng.random(n) * 4).tolist(),
            reward=float(rng.normal()),
            inference_metadata=meta,
        )
        if teacher:
            turn.teacher_logprobs = (-rng.random(n)).tolist()
            turn.teacher_top_ids = [rng.choice(50, K, replace=False).tolist() for _ in range(n)]
            turn.teacher_top_logprobs = (-rng.random((n, K))).tolist()
        turns.append(turn)
        if j % 2 == 0:
            turns.append(Turn("tool", "t", rng.integers(0, 50, int(rng.integers(0, 4))).tolist(), reward=0.5))
    return Rollout("e", "p", turns, metadata={"truncated": bool(rng.random() < 0.2)})


def _reference_sequence(r: Rollout, advantage: float, credit: str | None, token_adv) -> dict[str, np.ndarray | None]:
    """Each field from the rollout's own views (`loss_mask`, `sampler_logprobs`, `token_versions`, ...)."""
    mask = r.loss_mask()
    per_token = np.float32(advantage) if token_adv is None else np.asarray(token_adv, np.float32)
    top = r.teacher_top(r.teacher_top_k) if r.has_teacher_logprobs and r.teacher_top_k else (None, None)
    return {
        "token_ids": np.asarray(r.token_ids, np.int32),
        "loss_mask": mask,
        "advantages": np.where(mask, per_token, np.float32(0.0)).astype(np.float32),
        "sampler_logprobs": r.sampler_logprobs(),
        "token_versions": r.token_versions(),
        "rewards": None if credit is None else token_rewards(r, per_turn=credit == "per_turn").astype(np.float32),
        "teacher_logprobs": r.teacher_logprobs() if r.has_teacher_logprobs else None,
        "teacher_top_ids": top[0],
        "teacher_top_logprobs": top[1],
    }


def _reference_pack(seqs: list[Sequence], assignment: list[int | None], num_rows: int, row_len: int):
    """The batch's arrays, each placed sequence copied into its row one at a time."""
    placed = [s for s, row in zip(seqs, assignment, strict=True) if row is not None]
    arrays = {}
    for f in TOKEN_FIELDS:
        source = "rewards" if f.name == "truncated" else f.name
        if f.optional and (not placed or getattr(placed[0], source) is None):
            arrays[f.name] = None
            continue
        k = (getattr(placed[0], f.name).shape[1],) if f.top_k else ()
        arrays[f.name] = np.full((num_rows, row_len, *k), f.fill, f.dtype)
    fill, nseg = [0] * num_rows, [0] * num_rows
    for s, row in zip(seqs, assignment, strict=True):
        if row is None:
            continue
        a, b = fill[row], fill[row] + len(s)
        values = {f.name: getattr(s, f.name) for f in SEQUENCE_FIELDS}
        values.update(
            input_ids=s.token_ids,
            position_ids=np.arange(len(s)),
            segment_ids=nseg[row],
            truncated=s.episode_truncated,
        )
        for name, v in values.items():
            if arrays[name] is not None:
                arrays[name][row, a:b] = v
        fill[row], nseg[row] = b, nseg[row] + 1
    return arrays


@pytest.mark.parametrize("seed", range(8))
def test_sequences_and_packed_batches_equal_the_token_by_token_reference(seed):
    rng = np.random.default_rng(seed)
    teacher = seed % 4 == 3
    credit = (None, "per_turn", "episode_end")[seed % 3]
    rollouts = [_random_rollout(rng, teacher) for _ in range(int(rng.integers(1, 40)))]
    seqs = []
    for r in rollouts:
        adv = float(rng.normal())
        token_adv = rng.normal(size=r.num_tokens) if seed % 2 else None
        seq = Sequence.from_rollout(r, adv, credit, token_adv)
        expected = _reference_sequence(r, adv, credit, token_adv)
        assert seq.episode_truncated == r.truncated
        for name, want in expected.items():
            got = getattr(seq, name)
            if want is None:
                assert got is None, name
            else:
                assert got.dtype == want.dtype and np.array_equal(got, want), name
        seqs.append(seq)
    num_rows, row_len = int(rng.integers(1, 6)), 32
    assignment = pack_rows([len(s) for s in seqs], num_rows, row_len)
    batch, placed = pack(seqs, num_rows, row_len)
    assert placed == [i for i, row in enumerate(assignment) if row is not None]
    for name, want in _reference_pack(seqs, assignment, num_rows, row_len).items():
        got = getattr(batch, name)
        if want is None:
            assert got is None, name
        else:
            assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want), name


def test_a_field_of_the_wrong_length_is_refused():
    seq = Sequence.of(
        [1, 2, 3], loss_mask=[0, 1, 1], advantages=[0, 1, 1], sampler_logprobs=[0, -1], token_versions=[0] * 3
    )
    with pytest.raises(ValueError, match="sampler_logprobs"):
        pack([seq], 1, 8)


def test_nothing_placed_gives_an_empty_batch():
    seq = Sequence.of([1] * 9, loss_mask=[1] * 9, advantages=[0] * 9, sampler_logprobs=[0] * 9, token_versions=[0] * 9)
    batch, placed = pack([seq], 2, 8)
    assert placed == [] and (batch.segment_ids == -1).all() and not batch.loss_mask.any()


@pytest.mark.parametrize("seed", range(6))
def test_sequences_built_together_equal_those_built_one_by_one(seed):
    """`Sequence.from_rollouts` (one conversion per field for all the rollouts) against `from_rollout` on each: plain
    rollouts, some with per-token advantages, some with rewards for a critic or a teacher's logprobs (those go one by
    one), mixed in one call."""
    rng = np.random.default_rng(100 + seed)
    rollouts = [
        _random_rollout(rng, teacher=seed % 3 == 2 and rng.random() < 0.5) for _ in range(int(rng.integers(1, 30)))
    ]
    advantages = rng.normal(size=len(rollouts)).tolist()
    credits = [(None, "per_turn", "episode_end")[int(rng.integers(3))] if seed % 2 else None for _ in rollouts]
    token_adv = [rng.normal(size=r.num_tokens) if seed >= 3 and rng.random() < 0.5 else None for r in rollouts]
    together = Sequence.from_rollouts(rollouts, advantages, credits, token_adv)
    for r, a, c, ta, seq in zip(rollouts, advantages, credits, token_adv, together, strict=True):
        alone = Sequence.from_rollout(r, a, c, ta)
        assert seq.episode_truncated == alone.episode_truncated
        for name, want in alone.per_token().items():
            got = getattr(seq, name)
            assert (got is None) == (want is None), name
            if want is not None:
                assert got.dtype == want.dtype and np.array_equal(got, want), name
    assert Sequence.from_rollouts([], []) == []
    with pytest.raises(ValueError, match="token_advantages"):
        Sequence.from_rollouts(rollouts[:1], [0.0], None, [np.zeros(rollouts[0].num_tokens + 1)])
