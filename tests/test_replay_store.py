"""Rollout persistence: Parquet round trip through fsspec, corrupt files reported, the inspect CLI."""

import io
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from marin_rl import inspect_rollouts as inspect_cli
from marin_rl.replay.buffer import ReplayBuffer, ReplayConfig
from marin_rl.replay.store import ROLLOUT_SCHEMA, RolloutWriter, read_rollouts, rollout_to_row
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
