"""Rollout persistence: Parquet round trip through fsspec, corrupt files reported, the inspect CLI."""

import copy
import io
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from marin_rl import inspect_rollouts as inspect_cli
from marin_rl.replay.buffer import ReplayBuffer, ReplayConfig
from marin_rl.replay.store import (
    ROLLOUT_SCHEMA,
    RolloutWriter,
    read_rollouts,
    read_timeline,
    rollout_to_row,
    rollouts_table,
)
from marin_rl.types import InferenceMetadata, Rollout, RolloutGroup, Turn


def _group(env, rng, n=4, version=3):
    rollouts = []
    for i in range(n):
        gen = rng.integers(0, 100, int(rng.integers(1, 9))).tolist()
        meta = InferenceMetadata(
            server="http://s:1",
            model="m",
            temperature=0.7,
            max_tokens=8,
            version_start=version,
            version_end=version + 1,
            finish_reason="length" if i == 0 else "stop",
            latency_s=0.25,
            # odd rollouts report per-token versions: sampled across the update from `version` to `version + 1`
            token_versions=None if i % 2 == 0 else [version] * (len(gen) // 2) + [version + 1] * ((len(gen) + 1) // 2),
        )
        rollouts.append(
            Rollout(
                environment=env,
                problem_id="p7",
                turns=[
                    Turn("system", "sys ✓", [1, 2], timestamp=1.5),
                    Turn("user", "2+2=", rng.integers(0, 100, 4).tolist(), timestamp=2.0),
                    Turn(
                        "assistant",
                        "4",
                        gen,
                        sampler_logprobs=(-rng.random(len(gen)) * 3).tolist(),
                        reward=float(i % 2),
                        rewards={"correct": float(i % 2), "format": 0.5},
                        inference_metadata=meta,
                        timestamp=3.25,
                    ),
                    Turn("tool", "ok", [5], reward=0.25),
                ],
                metadata={"answer": 4, "nested": {"a": [1, 2.5, None]}, "s": "x"},
            )
        )
    return RolloutGroup(env, "p7", rollouts)


def test_buffer_persists_every_accepted_rollout_and_reads_back_identical(tmp_path):
    rng = np.random.default_rng(0)
    root = str(tmp_path / "rollouts" / "addition")
    buf = ReplayBuffer("addition", ReplayConfig(persist_flush_rows=6), vocab_size=100, rollout_dir=root)
    groups = [_group("addition", rng) for _ in range(3)]
    for g in groups:
        assert buf.admit(g.to_dict()).accepted
    bad = _group("addition", rng)
    bad.rollouts[0].turns[2].sampler_logprobs = []
    assert not buf.admit(bad).accepted  # rejected: not persisted
    buf.flush()
    files = sorted(os.listdir(root))
    assert len(files) == 2 and all(f.endswith(".parquet") for f in files)  # 8 rows at flush_rows=6, then 4
    result = read_rollouts(str(tmp_path / "rollouts"))
    assert result.errors == []
    assert [s.rollout.to_dict() for s in result.rollouts] == [r.to_dict() for g in groups for r in g.rollouts]
    assert [s.advantage for s in result.rollouts] == [it.advantage for it in buf.items]
    assert [s.group_id for s in result.rollouts] == [g.group_id for g in groups for _ in g.rollouts]
    assert pq.read_schema(os.path.join(root, files[0])).equals(ROLLOUT_SCHEMA, check_metadata=False)


def _teacher_scored(group, rng, k=3):
    """`group` with a teacher's logprobs and top-k on every sampled turn (the turn struct's optional lists)."""
    for r in group.rollouts:
        for t in r.turns:
            if t.is_sampled:
                n = len(t.token_ids)
                t.teacher_logprobs = (-rng.random(n)).tolist()
                t.teacher_top_ids = [rng.choice(100, k, replace=False).tolist() for _ in range(n)]
                t.teacher_top_logprobs = (-rng.random((n, k))).tolist()
    return group


def test_the_columnar_table_is_the_table_of_the_rows():
    """`rollouts_table` builds, column by column, exactly the table `from_pylist` makes of `rollout_to_row`'s rows:
    random groups with and without per-token advantages, teacher lists, per-token versions, segments, metadata."""
    rng = np.random.default_rng(7)
    for case in range(12):
        g = _group("e", rng, n=int(rng.integers(1, 6)), version=case)
        if case % 3 == 1:
            g = _teacher_scored(g, rng)
        if case % 4 == 3:
            g.rollouts[0].metadata = {}
            g.rollouts[-1].turns[1].rewards = {"a": -1.5}
        advantages = rng.normal(size=len(g.rollouts))
        token_adv = None
        if case % 2:
            token_adv = [rng.normal(size=r.num_tokens) if i % 3 else None for i, r in enumerate(g.rollouts)]
        segment, index = (None, None) if case % 5 == 0 else (case, 3 * case + 1)
        rows = [
            rollout_to_row(r, g.group_id, float(a), 12.5, None if token_adv is None else token_adv[i], segment, index)
            for i, (r, a) in enumerate(zip(g.rollouts, advantages, strict=True))
        ]
        expected = pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)
        n = len(g.rollouts)
        table = rollouts_table(
            g.rollouts, [g.group_id] * n, advantages, [12.5] * n, token_adv, [segment] * n, [index] * n
        )
        assert table.schema.equals(ROLLOUT_SCHEMA, check_metadata=True)
        assert table.equals(expected), case
        assert table.to_pylist() == expected.to_pylist(), case


def test_queued_rollouts_and_rows_are_written_in_order_as_the_rows_would_be(tmp_path):
    """`append_rollouts` (converted at the flush, all groups at once) and `append` of rows, mixed: the file holds the
    rows `rollout_to_row` gives, in the order they were queued, and flushes at `flush_rows` as before."""
    rng = np.random.default_rng(3)
    groups = [_group("e", rng, n=3, version=v) for v in range(4)]
    writer = RolloutWriter(str(tmp_path / "w"), flush_rows=7)
    expected = []
    for i, g in enumerate(groups):
        adv = rng.normal(size=3)
        rows = [
            rollout_to_row(r, g.group_id, float(a), 1.0 + i, None, 2, i + 1)
            for r, a in zip(g.rollouts, adv, strict=True)
        ]
        if i == 2:
            writer.append(rows)
        else:
            writer.append_rollouts(g.rollouts, g.group_id, adv, 1.0 + i, None, 2, i + 1)
        expected.extend(rows)
    writer.flush()
    assert writer.rows_written == 12 and len(writer.files_written) == 2  # 9 rows at flush_rows=7, then 3
    written = pa.concat_tables([pq.read_table(f) for f in writer.files_written])
    assert written.to_pylist() == pa.Table.from_pylist(expected, schema=ROLLOUT_SCHEMA).to_pylist()
    schema = pq.read_schema(writer.files_written[0])
    assert schema.equals(ROLLOUT_SCHEMA, check_metadata=False) and schema.metadata == ROLLOUT_SCHEMA.metadata


def test_writer_works_through_fsspec_urls():
    rng = np.random.default_rng(1)
    g = _group("e", rng)
    w = RolloutWriter("memory://store-test/rollouts/e", flush_rows=100)
    w.append([rollout_to_row(r, g.group_id, 0.5, 10.0) for r in g.rollouts])
    path = w.flush()
    assert path is not None and w.flush() is None
    result = read_rollouts("memory://store-test/rollouts")
    assert [s.rollout.to_dict() for s in result.rollouts] == [r.to_dict() for r in g.rollouts]
    assert all(s.advantage == 0.5 and s.accepted_at == 10.0 for s in result.rollouts)


def test_corrupt_and_foreign_files_are_reported_not_crashed_on(tmp_path):
    rng = np.random.default_rng(2)
    buf = ReplayBuffer("e", ReplayConfig(), rollout_dir=str(tmp_path / "e"))
    buf.admit(_group("e", rng))
    buf.flush()
    good = os.listdir(tmp_path / "e")[0]
    data = (tmp_path / "e" / good).read_bytes()
    (tmp_path / "e" / "truncated.parquet").write_bytes(data[: len(data) // 2])
    (tmp_path / "e" / "garbage.parquet").write_bytes(b"not parquet at all")
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "e" / "foreign.parquet")
    rows = [rollout_to_row(r, "g", 0.0, 0.0) for r in _group("e", rng).rollouts]
    rows[0]["turns"][1]["token_ids"] = []  # invalid: prompt turn fine, but make a sampled turn inconsistent
    rows[0]["turns"][2]["sampler_logprobs"] = [0.5]
    pq.write_table(pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA), tmp_path / "e" / "invalid.parquet")
    result = read_rollouts(str(tmp_path))
    assert len(result.rollouts) == 4
    bad = {os.path.basename(f): why for f, why in result.errors}
    assert set(bad) == {"truncated.parquet", "garbage.parquet", "foreign.parquet", "invalid.parquet"}
    assert "missing columns" in bad["foreign.parquet"] and "logprob" in bad["invalid.parquet"]

    out = io.StringIO()
    assert inspect_cli.summarize(str(tmp_path), samples=2, out=out) == 4
    text = out.getvalue()
    assert "5 files, 4 rollouts, 4 unreadable" in text and "UNREADABLE" in text


def test_inspect_prints_counts_reward_stats_and_samples(tmp_path, capsys):
    rng = np.random.default_rng(3)
    for env in ("a", "b"):
        buf = ReplayBuffer(env, ReplayConfig(), rollout_dir=str(tmp_path / env))
        for _ in range(2):
            buf.admit(_group(env, rng))
        buf.flush()
    assert inspect_cli.main([str(tmp_path), "--samples", "1"]) == 0
    text = capsys.readouterr().out
    assert "2 files, 16 rollouts, 0 unreadable" in text
    assert "== a: 8 rollouts in 2 groups" in text and "== b: 8 rollouts in 2 groups" in text
    assert "reward             mean 0.7500" in text  # per rollout: turn rewards 0 or 1, plus the tool's 0.25
    assert "rewards/correct" in text and "[assistant*] '4'" in text
    assert inspect_cli.main([str(tmp_path / "missing")]) == 2


def test_files_of_schema_version_1_are_still_read(tmp_path):
    """Version 1 named the turns' sampler logprobs `logprobs`; such files read back the same rollouts."""
    rng = np.random.default_rng(4)
    group = _group("e", rng)
    rows = [rollout_to_row(r, group.group_id, 0.5, 1.0) for r in group.rollouts]
    turn_v1 = pa.struct(
        [
            ("logprobs", f.type) if f.name == "sampler_logprobs" else f
            for f in ROLLOUT_SCHEMA.field("turns").type.value_type
        ]
    )
    schema_v1 = ROLLOUT_SCHEMA.set(
        ROLLOUT_SCHEMA.get_field_index("turns"), pa.field("turns", pa.list_(turn_v1))
    ).with_metadata({"marin_rl.schema_version": "1"})
    for row in rows:
        for t in row["turns"]:
            t["logprobs"] = t.pop("sampler_logprobs")
    path = tmp_path / "v1.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema_v1), path)
    result = read_rollouts(str(path))
    assert not result.errors
    assert [s.rollout.to_dict() for s in result.rollouts] == [r.to_dict() for r in group.rollouts]


# ---- timelines: resumes and rollbacks ------------------------------------------------------------------------------
def _accept(buf: ReplayBuffer, rng, n: int) -> list[str]:
    """Admit `n` groups into `buf`; their ids."""
    ids = []
    for _ in range(n):
        g = _group(buf.env_name, rng)
        assert buf.admit(g).accepted
        ids.append(g.group_id)
    return ids


def _checkpoint(buf: ReplayBuffer) -> dict:
    """What a checkpoint saves of the buffer (the driver flushes the rollout files first)."""
    buf.flush()
    return copy.deepcopy(buf.state_dict())


def test_two_rollbacks_leave_exactly_the_kept_groups_on_the_surviving_timeline(tmp_path):
    """A driver's segments, as the orchestrator makes them: segment 0 checkpoints after 5 groups, accepts 4 more and
    is rolled back (its learner replaced) to that checkpoint; segment 1 accepts 6 (checkpoint after 3 of them) and
    dies; segment 2 resumes from segment 1's checkpoint and accepts 2. Survivors: segment 0's first 5, segment 1's
    first 3, segment 2's 2 = 10 groups, the final buffer's `accepted_groups`."""
    rng = np.random.default_rng(5)
    root = str(tmp_path / "rollouts" / "e")
    buf = ReplayBuffer("e", ReplayConfig(), vocab_size=100, rollout_dir=root)
    buf.begin_segment(0, step=0)
    kept = _accept(buf, rng, 5)
    ckpt_a = _checkpoint(buf)  # step 3, say
    lost = _accept(buf, rng, 4)
    buf.flush()
    # learner replaced: the driver restores the checkpoint into the same buffer and begins segment 1
    buf.load_state_dict(ckpt_a)
    assert buf.recorded_segments() == [0]
    buf.begin_segment(1, step=3)
    kept += _accept(buf, rng, 3)
    ckpt_b = _checkpoint(buf)  # step 6
    lost += _accept(buf, rng, 3)
    buf.flush()
    # the driver is SIGKILLed; a new driver's fresh buffer resumes from the latest checkpoint (segment 1's)
    buf = ReplayBuffer("e", ReplayConfig(), vocab_size=100, rollout_dir=root)
    buf.load_state_dict(ckpt_b)
    buf.begin_segment(2, step=6)
    kept += _accept(buf, rng, 2)
    buf.flush()

    assert buf.accepted_groups == 10
    surviving = read_rollouts(str(tmp_path / "rollouts"))
    assert surviving.errors == [] and surviving.superseded == 7 * 4
    assert surviving.num_groups == buf.accepted_groups == len(kept)
    assert {s.group_id for s in surviving.rollouts} == set(kept)
    assert sorted({(s.segment, s.group_index) for s in surviving.rollouts}) == [
        *[(0, i) for i in range(1, 6)],
        *[(1, i) for i in range(6, 9)],
        (2, 9),
        (2, 10),
    ]
    everything = read_rollouts(root, timeline="all")
    assert everything.num_groups == 17 and everything.superseded == 28
    assert {s.group_id for s in everything.rollouts if s.superseded} == set(lost)
    segments = everything.timelines[root]
    assert [(s["segment"], s["parent"], s["start_step"], s["start_group"]) for s in segments] == [
        (0, None, 0, 0),
        (1, 0, 3, 5),
        (2, 1, 6, 8),
    ]


def test_a_rollback_to_the_start_and_a_fresh_rerun_supersede_every_earlier_group(tmp_path):
    """A learner that dies before the first checkpoint returns to the run's initial state: everything its segment
    accepted is superseded. A run started afresh in a directory whose earlier run never checkpointed (the timeline's
    newest segment has no parent) supersedes that earlier run's groups too."""
    rng = np.random.default_rng(6)
    root = str(tmp_path / "e")
    buf = ReplayBuffer("e", ReplayConfig(), rollout_dir=root)
    buf.begin_segment(0, step=0)
    initial = _checkpoint(buf)
    _accept(buf, rng, 3)
    buf.load_state_dict(initial)
    buf.begin_segment(1, step=0)
    kept = _accept(buf, rng, 2)
    buf.flush()
    result = read_rollouts(root)
    assert {s.group_id for s in result.rollouts} == set(kept) and result.superseded == 3 * 4

    fresh = ReplayBuffer("e", ReplayConfig(), rollout_dir=root)  # the same command, no checkpoint to resume
    fresh.begin_segment(max(fresh.recorded_segments()) + 1, step=0)
    again = _accept(fresh, rng, 1)
    fresh.flush()
    result = read_rollouts(root)
    assert {s.group_id for s in result.rollouts} == set(again) and result.superseded == 5 * 4


def test_rows_without_segments_and_directories_without_a_timeline_count(tmp_path):
    rng = np.random.default_rng(7)
    buf = ReplayBuffer("e", ReplayConfig(), rollout_dir=str(tmp_path / "e"))  # no segment begun (e.g. the API)
    _accept(buf, rng, 2)
    buf.flush()
    result = read_rollouts(str(tmp_path))
    assert result.num_groups == 2 and result.superseded == 0 and result.timelines == {}
    assert all(s.segment is None and s.group_index in (1, 2) for s in result.rollouts)
    (tmp_path / "e" / "timeline.json").write_text("{not json")
    result = read_rollouts(str(tmp_path))
    assert result.num_groups == 2 and len(result.errors) == 1 and "malformed timeline" in result.errors[0][1]
    try:
        read_rollouts(str(tmp_path), timeline="latest")
    except ValueError as e:
        assert "timeline must be one of ['surviving', 'all']" in str(e)
    else:
        raise AssertionError("an unknown timeline was accepted")


def test_the_timeline_is_written_through_fsspec_urls():
    rng = np.random.default_rng(8)
    root = "memory://timeline-test/rollouts/e"
    buf = ReplayBuffer("e", ReplayConfig(), rollout_dir=root)
    buf.begin_segment(0, step=0)
    state = _checkpoint(buf)
    _accept(buf, rng, 2)
    buf.load_state_dict(state)
    buf.begin_segment(1, step=0)
    kept = _accept(buf, rng, 1)
    buf.flush()
    assert [s["segment"] for s in read_timeline(root)] == [0, 1]
    result = read_rollouts("memory://timeline-test/rollouts")
    assert {s.group_id for s in result.rollouts} == set(kept) and result.superseded == 8


def test_inspect_counts_the_surviving_timeline_and_shows_the_rest_on_request(tmp_path, capsys):
    rng = np.random.default_rng(9)
    buf = ReplayBuffer("e", ReplayConfig(), rollout_dir=str(tmp_path / "e"))
    buf.begin_segment(0, step=0)
    state = _checkpoint(buf)
    _accept(buf, rng, 3)
    buf.load_state_dict(state)
    buf.begin_segment(1, step=0)
    _accept(buf, rng, 2)
    buf.flush()
    assert inspect_cli.main([str(tmp_path), "--samples", "0"]) == 0
    text = capsys.readouterr().out
    assert "8 rollouts (12 superseded by resumes or rollbacks; --all-timelines shows them)" in text
    assert "== e: 8 rollouts in 2 groups" in text
    assert inspect_cli.main([str(tmp_path), "--samples", "0", "--all-timelines"]) == 0
    text = capsys.readouterr().out
    assert "20 rollouts (12 of them superseded by resumes or rollbacks)" in text
    assert "== e: 20 rollouts in 5 groups" in text
    assert "segment 0: from the start at step 0, 3 groups, 3 superseded" in text
    assert "segment 1: from segment 0 at step 0 (after 0 groups), 2 groups, 0 superseded" in text
