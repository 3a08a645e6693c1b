"""The per-token fields, declared once (`marin_rl.types.TOKEN_FIELDS`): every one travels rollout -> `Sequence` ->
`pack` -> `PackedBatch` -> `RlExample` with its dtype, trailing shape and padding; truncation cuts every one; an
optional one that is absent stays None all the way."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from marin_rl.learner.batch import TEACHER_TOP_K, RlExample, from_raw, raw_fields, to_example
from marin_rl.replay.packing import Sequence, pack
from marin_rl.types import (
    SEQUENCE_FIELDS,
    TOKEN_FIELDS,
    InferenceMetadata,
    PackedBatch,
    Rollout,
    Turn,
    check_token_fields,
)

K = 2


def _rollout(prompt: list[int], sampled: list[int], *, teacher: bool, finish: str = "length") -> Rollout:
    meta = InferenceMetadata(server="s", version_start=3, version_end=3, finish_reason=finish)
    turn = Turn("assistant", "", list(sampled), sampler_logprobs=[-0.5] * len(sampled), inference_metadata=meta)
    if teacher:
        turn.teacher_logprobs = [-0.25] * len(sampled)
        turn.teacher_top_ids = [[t, t + 1] for t in sampled]
        turn.teacher_top_logprobs = [[-0.1, -2.0]] * len(sampled)
        # a mixture of experts' routing (1 layer × 2 experts): the prompt's, then the sampled tokens' (the last
        # one never fed: none)
        turn.routed_experts = [[t % 4, (t + 1) % 4] for t in sampled[:-1]] + [[-1, -1]]
    first = Turn("user", "", list(prompt), routed_experts=[[0, 3]] * len(prompt) if teacher else None)
    return Rollout("env", "p", [first, turn])


def test_the_classes_agree_with_the_declaration():
    for cls, fields in ((PackedBatch, TOKEN_FIELDS), (RlExample, TOKEN_FIELDS), (Sequence, SEQUENCE_FIELDS)):
        check_token_fields(cls, fields)
    assert [f.name for f in dataclasses.fields(PackedBatch)] == [f.name for f in TOKEN_FIELDS]

    @dataclasses.dataclass
    class Stale:
        input_ids: np.ndarray

    with pytest.raises(TypeError, match="position_ids"):
        check_token_fields(Stale)


def test_every_field_travels_from_rollout_to_example():
    rollouts = [_rollout([1, 2], [5, 6, 7], teacher=True), _rollout([3], [8, 9], teacher=True)]
    seqs = [Sequence.from_rollout(r, 1.5, reward_credit="episode_end") for r in rollouts]
    for seq in seqs:
        for f in SEQUENCE_FIELDS:
            v = getattr(seq, f.name)
            assert v is not None and v.dtype == f.dtype, f.name
            assert v.shape == ((len(seq), K) if f.top_k else (len(seq),)), f.name
    rows, row_len = 2, 10
    batch, placed = pack(seqs, rows, row_len, assignment=[0, 0])
    assert placed == [0, 1]
    for f in TOKEN_FIELDS:
        v = getattr(batch, f.name)
        assert v is not None and v.dtype == f.dtype, f.name
        assert v.shape == ((rows, row_len, K) if f.top_k else (rows, row_len)), f.name
        # padding: the end of row 0 and all of row 1 hold the declared fill
        assert (v[0, 8:] == f.fill).all() and (v[1] == f.fill).all(), f.name
        if f.layout:
            continue
        # every Sequence field lands as it was, one sequence after the other
        np.testing.assert_array_equal(v[0, :8], np.concatenate([getattr(s, f.name) for s in seqs]), err_msg=f.name)
    np.testing.assert_array_equal(batch.input_ids[0, :8], [1, 2, 5, 6, 7, 3, 8, 9])
    np.testing.assert_array_equal(batch.position_ids[0, :8], [0, 1, 2, 3, 4, 0, 1, 2])
    np.testing.assert_array_equal(batch.segment_ids[0, :8], [0, 0, 0, 0, 0, 1, 1, 1])
    assert batch.truncated[0, :8].all()  # both episodes hit their length limit
    np.testing.assert_array_equal(batch.token_versions[0, :8], [-1, -1, 3, 3, 3, -1, 3, 3])
    np.testing.assert_array_equal(batch.teacher_top_ids[0, 2], [5, 6])
    np.testing.assert_array_equal(batch.routed_experts[0, :5], [[0, 3], [0, 3], [1, 2], [2, 3], [-1, -1]])
    assert {f.trailing_axis for f in TOKEN_FIELDS if f.top_k} == {TEACHER_TOP_K, "routed_experts"}

    ex = to_example(batch)
    for f in TOKEN_FIELDS:
        named = getattr(ex, f.name)
        assert named is not None and named.array.dtype == f.dtype, f.name
        names = tuple(a.name for a in named.axes)
        assert names == (("batch", "position", f.trailing_axis) if f.top_k else ("batch", "position")), f.name
        np.testing.assert_array_equal(np.asarray(named.array), getattr(batch, f.name), err_msg=f.name)
    again = from_raw(raw_fields(ex))
    for f in TOKEN_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(again, f.name).array), getattr(batch, f.name))


def test_truncation_cuts_every_field():
    seq = Sequence.from_rollout(_rollout([1, 2], [5, 6, 7], teacher=True), 1.0, reward_credit="per_turn")
    cut = seq.truncated(3)
    assert len(cut) == 3 and cut.episode_truncated
    for f in SEQUENCE_FIELDS:
        np.testing.assert_array_equal(getattr(cut, f.name), getattr(seq, f.name)[:3], err_msg=f.name)
    whole = Sequence.from_rollout(_rollout([1], [5], teacher=False, finish="stop"), 1.0)
    assert not whole.truncated(2).episode_truncated, "nothing cut, not truncated"
    assert whole.truncated(1).episode_truncated
    assert whole.truncated(1).teacher_logprobs is None


def test_absent_optional_fields_stay_none():
    seqs = [Sequence.from_rollout(_rollout([1, 2], [5, 6], teacher=False), 1.0)]
    for f in SEQUENCE_FIELDS:
        assert (getattr(seqs[0], f.name) is None) == f.optional, f.name
    batch, _ = pack(seqs, 1, 8)
    ex = to_example(batch)
    for f in TOKEN_FIELDS:
        assert (getattr(batch, f.name) is None) == f.optional, f.name
        assert (getattr(ex, f.name) is None) == f.optional, f.name
    assert set(raw_fields(ex)) == {f.name for f in TOKEN_FIELDS if not f.optional}


def test_an_optional_field_is_all_or_nothing_in_a_batch():
    scored = Sequence.from_rollout(_rollout([1], [5], teacher=True), 0.0)
    plain = Sequence.from_rollout(_rollout([1], [5], teacher=False), 0.0)
    with pytest.raises(ValueError, match="no teacher logprobs"):
        pack([scored, plain], 2, 4)
    gae = Sequence.from_rollout(_rollout([1], [5], teacher=False), 0.0, reward_credit="per_turn")
    with pytest.raises(ValueError, match="no rewards"):
        pack([gae, plain], 2, 4)
    # one left out of the batch does not count
    batch, placed = pack([gae, plain], 1, 2, assignment=[0, None])
    assert placed == [0] and batch.rewards is not None


def test_a_turns_dict_is_asdicts_and_shares_nothing_with_the_turn():
    """`Turn.to_dict` (what persistence and the Ray wire write) equals `dataclasses.asdict` and copies what it holds."""
    import dataclasses

    from marin_rl.types import InferenceMetadata, Turn

    turn = Turn(
        "assistant",
        "x",
        [1, 2, 3],
        sampler_logprobs=[-0.1, -0.2, -0.3],
        rewards={"correct": 1.0},
        inference_metadata=InferenceMetadata("s", version_start=0, version_end=1, token_versions=[0, 0, 1]),
        teacher_logprobs=[-1.0] * 3,
        teacher_top_ids=[[1, 2]] * 3,
        teacher_top_logprobs=[[-1.0, -2.0]] * 3,
    )
    out = turn.to_dict()
    assert out == dataclasses.asdict(turn)
    out["token_ids"].append(9)
    out["teacher_top_ids"][0].append(5)
    out["rewards"]["correct"] = 0.0
    out["inference_metadata"]["token_versions"].append(3)
    assert turn.token_ids == [1, 2, 3] and turn.teacher_top_ids[0] == [1, 2] and turn.rewards == {"correct": 1.0}
    assert turn.inference_metadata.token_versions == [0, 0, 1]
