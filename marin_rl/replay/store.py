"""Rollout persistence: accepted rollouts appended to Parquet files through fsspec (local path or gs://).

One row per rollout, with an explicit Arrow schema (`ROLLOUT_SCHEMA`); nothing is pickled. Free-form rollout
metadata is stored as a JSON string. A writer buffers rows (the replay buffer's accepted rollouts as they are,
converted to Arrow column by column at the flush, `rollouts_table`: no dict per row) and writes one new file per flush,
`part-<start time>-<writer id>-<sequence>.parquet`, so files are never rewritten and concurrent writers never
collide. `read_rollouts` reads a file or a directory tree back, validating each row, and reports files it cannot
read instead of failing.

Timelines: a run that resumes from a checkpoint, or rolls back to one when its learner is replaced, samples again
the problems of the steps after that checkpoint, while the groups the lost steps accepted stay in the files. So every
row names its run segment (`segment`: a new one starts at each start, resume and rollback) and its group's place
in its environment's sequence of accepted groups (`group_index`, 1, 2, ...: the replay buffer's `accepted_groups`
counter, which checkpoints save and restore). Each directory holds a timeline (`timeline.json`, `record_segment`):
per segment, the segment whose state it continued from (`parent`: the one that wrote the checkpoint; none for a
fresh start), the learner step and the accepted-group count it started at. The surviving timeline is the chain of
parents of the newest segment: a segment's groups survive up to the count its successor on the chain started from;
the rest were superseded (`surviving_groups`). `read_rollouts` returns the surviving timeline by default and every
group with `timeline="all"`. Rows written before segments existed, and directories without a timeline, count as
surviving.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import operator
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from marin_rl.atomic_files import write_atomically
from marin_rl.types import TURN_TOKEN_LISTS, InferenceMetadata, Rollout, RolloutFormatError

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 2
"""Bumped whenever `ROLLOUT_SCHEMA` changes incompatibly. Version 1 named the turns' `sampler_logprobs` field
`logprobs`; `read_rollouts` reads both."""

OPTIONAL_COLUMNS = ("token_advantages", "segment", "group_index")
"""Columns added without a version bump: files written before them lack them and read as None (so do the turns'
`teacher_logprobs`, `teacher_top_ids`, `teacher_top_logprobs` and `routed_experts`, fields of the turn struct added
the same way)."""

_ARROW_TYPES = {"str": pa.string(), "int": pa.int64(), "float": pa.float64(), "list[int] | None": pa.list_(pa.int64())}
_META = pa.struct([(f.name, _ARROW_TYPES[f.type]) for f in dataclasses.fields(InferenceMetadata)])
"""`InferenceMetadata` as an Arrow struct, field by field."""


def _token_list_type(dtype: type, top_k: bool) -> pa.DataType:
    element = pa.list_(pa.from_numpy_dtype(dtype))
    return pa.list_(element) if top_k else element


_TURN_LISTS = {name: _token_list_type(dtype, top_k) for name, (dtype, top_k) in TURN_TOKEN_LISTS.items()}
_TURN = pa.struct(
    [
        ("role", pa.string()),
        ("message", pa.string()),
        ("token_ids", pa.list_(pa.int32())),
        ("sampler_logprobs", _TURN_LISTS.pop("sampler_logprobs")),
        ("reward", pa.float64()),
        ("rewards", pa.map_(pa.string(), pa.float64())),
        ("inference_metadata", _META),
        ("timestamp", pa.float64()),
        *_TURN_LISTS.items(),  # the teacher's and the routed experts, added later (`TURN_TOKEN_LISTS`)
    ]
)
ROLLOUT_SCHEMA = pa.schema(
    [
        ("environment", pa.string()),
        ("problem_id", pa.string()),
        ("rollout_uid", pa.string()),
        ("group_id", pa.string()),
        ("advantage", pa.float64()),
        ("reward", pa.float64()),
        ("num_tokens", pa.int64()),
        ("num_generated_tokens", pa.int64()),
        ("oldest_version", pa.int64()),
        ("accepted_at", pa.float64()),
        ("turns", pa.list_(_TURN)),
        ("metadata_json", pa.string()),
        ("token_advantages", pa.list_(pa.float32())),
        ("segment", pa.int64()),
        ("group_index", pa.int64()),
    ],
    metadata={"marin_rl.schema_version": str(SCHEMA_VERSION)},
)
"""Arrow schema of the rollout Parquet files (one row per rollout)."""


@dataclass
class StoredRollout:
    """A rollout read back from disk, with what the replay buffer knew about it when it was accepted."""

    rollout: Rollout
    group_id: str
    advantage: float
    accepted_at: float
    token_advantages: list[float] | None = None
    """Per-token advantages ('turn_rloo'), aligned with the rollout's tokens; None: `advantage` on every sampled
    token (and in files written before the column existed)."""
    segment: int | None = None
    """Run segment that accepted its group (None: written before segments were recorded)."""
    group_index: int | None = None
    """Its group's place (1, 2, ...) in its environment's accepted groups along the segment's timeline."""
    superseded: bool = False
    """Its group was accepted by steps that a later resume or rollback discarded (module docstring)."""
    file: str = ""
    """The Parquet file it was read from."""


@dataclass
class ReadResult:
    """Rollouts read from a path, the files that could not be read (path, reason), and the timelines found."""

    rollouts: list[StoredRollout] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    superseded: int = 0
    """Rollouts of superseded groups: left out (timeline 'surviving'), or returned marked (timeline 'all')."""
    timelines: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """The segments recorded in each directory read (directories without a timeline are absent)."""

    @property
    def num_groups(self) -> int:
        """Distinct groups among `rollouts`."""
        return len({s.group_id for s in self.rollouts})


def rollout_to_row(
    rollout: Rollout,
    group_id: str,
    advantage: float,
    accepted_at: float,
    token_advantages=None,
    segment: int | None = None,
    group_index: int | None = None,
) -> dict[str, Any]:
    """The Parquet row of a rollout (plain Python values matching `ROLLOUT_SCHEMA`); `token_advantages`: per-token
    advantages, when the estimator gives them; `segment` and `group_index`: where its group is in the run's
    timelines (module docstring)."""
    turns = [{**t.to_dict(), "rewards": list(t.rewards.items())} for t in rollout.turns]  # the turn struct's fields
    return {
        "environment": rollout.environment,
        "problem_id": rollout.problem_id,
        "rollout_uid": rollout.rollout_uid,
        "group_id": group_id,
        "advantage": float(advantage),
        "reward": rollout.reward,
        "num_tokens": rollout.num_tokens,
        "num_generated_tokens": rollout.num_sampled_tokens,
        "oldest_version": rollout.oldest_version,
        "accepted_at": float(accepted_at),
        "turns": turns,
        "metadata_json": json.dumps(rollout.metadata, sort_keys=True),
        "token_advantages": None if token_advantages is None else [float(a) for a in token_advantages],
        "segment": None if segment is None else int(segment),
        "group_index": None if group_index is None else int(group_index),
    }


_meta_fields = operator.attrgetter(*(f.name for f in _META))
_METADATA_JSON = json.JSONEncoder(sort_keys=True)
"""`json.dumps(metadata, sort_keys=True)`, with the encoder built once."""


def rollouts_table(
    rollouts: list[Rollout],
    group_ids: list[str],
    advantages: Any,
    accepted_at: Any,
    token_advantages: list[Any] | None = None,
    segments: list[int | None] | None = None,
    group_indices: list[int | None] | None = None,
) -> pa.Table:
    """The Parquet rows of `rollouts` as one Arrow table, built column by column (one conversion per column for all
    the rollouts, however many groups they come from): the same table as `pa.Table.from_pylist` of their
    `rollout_to_row` rows, without a dict per row and turn. Per rollout: `group_ids`, `advantages`, `accepted_at`,
    `token_advantages` (an array or None; None for all: none has them), `segments` and `group_indices` (None for all:
    none recorded)."""
    n = len(rollouts)
    turns = [t for r in rollouts for t in r.turns]
    turn_offsets = np.zeros(n + 1, np.int32)
    np.cumsum([len(r.turns) for r in rollouts], out=turn_offsets[1:])
    lengths = np.fromiter((len(t.token_ids) for t in turns), np.int64, len(turns))
    sampled = np.fromiter((t.sampler_logprobs is not None for t in turns), bool, len(turns))
    turn_rollout = np.repeat(np.arange(n), np.diff(turn_offsets))
    num_tokens = np.bincount(turn_rollout, weights=lengths, minlength=n).astype(np.int64)
    num_sampled = np.bincount(turn_rollout, weights=lengths * sampled, minlength=n).astype(np.int64)
    metas = [t.inference_metadata for t in turns]
    blank = (None,) * _META.num_fields
    rows = [blank if m is None else _meta_fields(m) for m in metas]
    meta_values = zip(*rows, strict=True) if rows else [()] * len(blank)
    meta_columns = [pa.array(v, f.type) for v, f in zip(meta_values, _META, strict=True)]
    turn_columns = {
        "role": pa.array([t.role for t in turns], pa.string()),
        "message": pa.array([t.message for t in turns], pa.string()),
        "token_ids": pa.array([t.token_ids for t in turns], pa.list_(pa.int32())),
        "reward": pa.array([t.reward for t in turns], pa.float64()),
        "rewards": pa.array([list(t.rewards.items()) for t in turns], _TURN.field("rewards").type),
        "inference_metadata": pa.StructArray.from_arrays(
            meta_columns, fields=list(_META), mask=pa.array([m is None for m in metas], pa.bool_())
        ),
        "timestamp": pa.array([t.timestamp for t in turns], pa.float64()),
    }
    for name in TURN_TOKEN_LISTS:
        turn_columns[name] = pa.array([getattr(t, name) for t in turns], _TURN.field(name).type)
    turn_struct = pa.StructArray.from_arrays([turn_columns[f.name] for f in _TURN], fields=list(_TURN))
    token_adv = [None] * n if token_advantages is None else token_advantages
    columns = {
        "environment": pa.array([r.environment for r in rollouts], pa.string()),
        "problem_id": pa.array([r.problem_id for r in rollouts], pa.string()),
        "rollout_uid": pa.array([r.rollout_uid for r in rollouts], pa.string()),
        "group_id": pa.array(group_ids, pa.string()),
        "advantage": pa.array(np.asarray(advantages, np.float64).reshape(n), pa.float64()),
        "reward": pa.array([r.reward for r in rollouts], pa.float64()),
        "num_tokens": pa.array(num_tokens, pa.int64()),
        "num_generated_tokens": pa.array(num_sampled, pa.int64()),
        "oldest_version": pa.array([r.oldest_version for r in rollouts], pa.int64()),
        "accepted_at": pa.array(np.asarray(accepted_at, np.float64).reshape(n), pa.float64()),
        "turns": pa.ListArray.from_arrays(pa.array(turn_offsets, pa.int32()), turn_struct),
        "metadata_json": pa.array([_METADATA_JSON.encode(r.metadata) for r in rollouts], pa.string()),
        "token_advantages": pa.array(
            [None if a is None else np.asarray(a, np.float64).astype(np.float32) for a in token_adv],
            pa.list_(pa.float32()),
        ),
        "segment": pa.array([None] * n if segments is None else segments, pa.int64()),
        "group_index": pa.array([None] * n if group_indices is None else group_indices, pa.int64()),
    }
    return pa.Table.from_arrays([columns[f.name] for f in ROLLOUT_SCHEMA], schema=ROLLOUT_SCHEMA)


def row_to_stored(row: dict[str, Any]) -> StoredRollout:
    """Inverse of `rollout_to_row` (schema version 1 rows too); validates the rollout (raises `RolloutFormatError`)."""
    try:
        turns = []
        for t in row["turns"]:
            t = dict(t)
            t["rewards"] = dict(t.get("rewards") or [])
            turns.append(t)
        rollout = Rollout.from_dict(
            {
                "environment": row["environment"],
                "problem_id": row["problem_id"],
                "rollout_uid": row["rollout_uid"],
                "turns": turns,
                "metadata": json.loads(row["metadata_json"]),
            }
        )
        return StoredRollout(
            rollout=rollout,
            group_id=str(row["group_id"]),
            advantage=float(row["advantage"]),
            accepted_at=float(row["accepted_at"]),
            token_advantages=row.get("token_advantages"),
            segment=None if row.get("segment") is None else int(row["segment"]),
            group_index=None if row.get("group_index") is None else int(row["group_index"]),
        )
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
        if isinstance(e, RolloutFormatError):
            raise
        raise RolloutFormatError(f"malformed rollout row: {type(e).__name__}: {e}") from e


@dataclass
class _PendingRollouts:
    """Rollouts queued for a file, with their per-row fields (`rollouts_table`'s arguments)."""

    rollouts: list[Rollout] = field(default_factory=list)
    group_ids: list[str] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    accepted_at: list[float] = field(default_factory=list)
    token_advantages: list[Any] = field(default_factory=list)
    segments: list[int | None] = field(default_factory=list)
    group_indices: list[int | None] = field(default_factory=list)


class RolloutWriter:
    """Appends rollouts to Parquet files under one directory (local or any fsspec URL such as gs://)."""

    def __init__(self, directory: str, flush_rows: int = 1024, flush_interval_s: float = 60.0):
        if flush_rows < 1:
            raise ValueError(f"flush_rows must be >= 1, got {flush_rows}")
        self.directory = directory.rstrip("/")
        self.flush_rows = flush_rows
        self.flush_interval_s = flush_interval_s
        self.fs, self._root = fsspec.core.url_to_fs(self.directory)
        self.fs.makedirs(self._root, exist_ok=True)
        self._tables: list[pa.Table] = []  # queued rows: tables, in order, then `_pending`
        self._pending = _PendingRollouts()  # rollouts queued by `append_rollouts`, converted at the next flush
        self._queued = 0
        self._last_flush = time.time()
        self._prefix = f"part-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self._seq = 0
        self.rows_written = 0
        self.files_written: list[str] = []

    def append(self, rows: list[dict[str, Any]] | pa.Table) -> None:
        """Queue rows (`rollout_to_row`'s dicts, or a table of `ROLLOUT_SCHEMA` such as `rollouts_table` builds);
        writes a file once `flush_rows` rows or `flush_interval_s` seconds have accumulated."""
        table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)
        if not table.schema.equals(ROLLOUT_SCHEMA, check_metadata=False):
            raise ValueError(f"rollout rows must have the rollout schema, got {table.schema}")
        self._convert_pending()  # rows keep the order they were appended in
        self._tables.append(table)
        self._queued += table.num_rows
        self._maybe_flush()

    def append_rollouts(
        self,
        rollouts: list[Rollout],
        group_id: str,
        advantages: Any,
        accepted_at: float,
        token_advantages: list[Any] | None = None,
        segment: int | None = None,
        group_index: int | None = None,
    ) -> None:
        """Queue a group's rollouts as rows (`rollout_to_row`'s arguments, an advantage and an optional per-token
        advantage array per rollout). They are converted at the next flush, every rollout queued since the previous
        one in one columnar conversion (`rollouts_table`), not row by row; a rollout must not change until then."""
        n = len(rollouts)
        p = self._pending
        p.rollouts.extend(rollouts)
        p.group_ids.extend([group_id] * n)
        p.advantages.extend(np.asarray(advantages, np.float64).reshape(n).tolist())
        p.accepted_at.extend([float(accepted_at)] * n)
        p.token_advantages.extend([None] * n if token_advantages is None else token_advantages)
        p.segments.extend([None if segment is None else int(segment)] * n)
        p.group_indices.extend([None if group_index is None else int(group_index)] * n)
        self._queued += n
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if self._queued >= self.flush_rows or time.time() - self._last_flush >= self.flush_interval_s:
            self.flush()

    def _convert_pending(self) -> None:
        p = self._pending
        if p.rollouts:
            self._tables.append(
                rollouts_table(
                    p.rollouts,
                    p.group_ids,
                    p.advantages,
                    p.accepted_at,
                    p.token_advantages,
                    p.segments,
                    p.group_indices,
                )
            )
            self._pending = _PendingRollouts()

    def flush(self) -> str | None:
        """Write the queued rows to a new Parquet file; returns its path (None when nothing was queued)."""
        self._last_flush = time.time()
        if not self._queued:
            return None
        self._convert_pending()
        table = pa.concat_tables(self._tables).replace_schema_metadata(ROLLOUT_SCHEMA.metadata)
        path = f"{self._root}/{self._prefix}-{self._seq:06d}.parquet"
        with self.fs.open(path, "wb") as f:
            pq.write_table(table, f)
        self._seq += 1
        self.rows_written += self._queued
        self._tables, self._queued = [], 0
        self.files_written.append(path)
        return path

    def close(self) -> None:
        """Flush what is queued (safe to call more than once)."""
        try:
            self.flush()
        except Exception:  # at interpreter exit: report, never raise
            logger.exception("rollout writer: could not flush %d rows to %s", self._queued, self.directory)


def list_parquet(path: str) -> list[str]:
    """Parquet files at `path`: the file itself, or every `*.parquet` below a directory, sorted."""
    fs, root = fsspec.core.url_to_fs(path)
    if fs.isfile(root):
        return [root]
    if not fs.exists(root):
        raise FileNotFoundError(f"no such file or directory: {path}")
    return sorted(p for p in fs.find(root) if p.endswith(".parquet"))


# ---- timelines ------------------------------------------------------------------------------------------------
TIMELINE_FILE = "timeline.json"
"""The segments of the run that wrote a rollout directory (module docstring), next to its Parquet files."""
TIMELINES = ("surviving", "all")


def read_timeline(directory: str) -> list[dict[str, Any]]:
    """The segments recorded in `directory`'s timeline, oldest first (empty when it has none); raises
    `RolloutFormatError` for a malformed one."""
    fs, root = fsspec.core.url_to_fs(directory.rstrip("/"))
    return _read_timeline(fs, root)


def _read_timeline(fs, root: str) -> list[dict[str, Any]]:
    path = f"{root}/{TIMELINE_FILE}"
    if not fs.exists(path):
        return []
    try:
        with fs.open(path, "rb") as f:
            data = json.load(f)
        segments = data["segments"]
        for s in segments:
            ok = isinstance(s["segment"], int) and isinstance(s["start_group"], int)
            if not ok or not (s["parent"] is None or isinstance(s["parent"], int)):
                raise TypeError(f"segment entry {s!r}")
    except (KeyError, TypeError, ValueError) as e:  # json's errors are ValueErrors
        raise RolloutFormatError(f"malformed timeline {path}: {type(e).__name__}: {e}") from e
    return segments


def record_segment(directory: str, segment: int, parent: int | None, start_step: int, start_group: int) -> None:
    """Add `segment` to `directory`'s timeline before it writes any row: it continues the state that `parent` saved
    (None: a fresh start), at learner step `start_step`, after `start_group` accepted groups.

    The file is replaced whole, atomically (a rename on local disks; a single-object write on object stores), so a
    reader sees the timeline before or after the new segment, never a torn one."""
    fs, root = fsspec.core.url_to_fs(directory.rstrip("/"))
    fs.makedirs(root, exist_ok=True)
    segments = [s for s in _read_timeline(fs, root) if s["segment"] != int(segment)]
    segments.append(
        {
            "segment": int(segment),
            "parent": None if parent is None else int(parent),
            "start_step": int(start_step),
            "start_group": int(start_group),
            "started_at": time.time(),
        }
    )
    data = json.dumps({"segments": segments}, indent=1).encode()
    write_atomically(fs, f"{root}/{TIMELINE_FILE}", data)


def surviving_groups(segments: list[dict[str, Any]]) -> dict[int, float]:
    """Segment -> the highest `group_index` of its groups on the surviving timeline (inf: all of them); segments
    absent from the result were superseded entirely. The surviving timeline is the newest segment and its chain of
    parents; a parent's groups survive up to the `start_group` of its successor on the chain."""
    by_id = {s["segment"]: s for s in segments}
    if not by_id:
        return {}
    current = max(by_id)
    keep: dict[int, float] = {current: math.inf}
    while by_id[current].get("parent") is not None:
        parent = by_id[current]["parent"]
        if parent in keep or parent not in by_id:  # a cycle or a parent never recorded: the chain ends here
            break
        keep[parent] = by_id[current]["start_group"]
        current = parent
    return keep


def _superseded(stored: StoredRollout, recorded: set[int], keep: dict[int, float]) -> bool:
    if stored.segment is None or stored.segment not in recorded:
        return False  # written before segments were recorded: cannot tell, so it counts
    limit = keep.get(stored.segment)
    return limit is None or (stored.group_index is not None and stored.group_index > limit)


def read_rollouts(path: str, timeline: str = "surviving") -> ReadResult:
    """The rollouts stored at `path` (file or directory): of the surviving timeline (default; module docstring), or
    `timeline="all"`: every one, superseded ones marked. Unreadable files are listed in `errors`, not raised."""
    if timeline not in TIMELINES:
        raise ValueError(f"timeline must be one of {list(TIMELINES)}, got {timeline!r}")
    fs, _ = fsspec.core.url_to_fs(path)
    result = ReadResult()
    survivors: dict[str, tuple[set[int], dict[int, float]]] = {}  # directory -> recorded segments, survivors
    required = set(ROLLOUT_SCHEMA.names) - set(OPTIONAL_COLUMNS)
    for file in list_parquet(path):
        result.files.append(file)
        try:
            with fs.open(file, "rb") as f:
                table = pq.read_table(f)
            missing = required - set(table.schema.names)
            if missing:
                raise RolloutFormatError(f"missing columns {sorted(missing)}")
            stored = [row_to_stored(row) for row in table.to_pylist()]
        except (OSError, pa.ArrowException, RolloutFormatError) as e:
            result.errors.append((file, f"{type(e).__name__}: {e}"))
            logger.warning("rollout store: cannot read %s: %s", file, e)
            continue
        directory = file.rsplit("/", 1)[0] if "/" in file else "."
        if directory not in survivors:
            try:
                segments = _read_timeline(fs, directory)
            except (OSError, RolloutFormatError) as e:  # then every row of the directory counts
                result.errors.append((f"{directory}/{TIMELINE_FILE}", f"{type(e).__name__}: {e}"))
                logger.warning("rollout store: cannot read the timeline of %s: %s", directory, e)
                segments = []
            if segments:
                result.timelines[directory] = segments
            survivors[directory] = ({s["segment"] for s in segments}, surviving_groups(segments))
        recorded, keep = survivors[directory]
        for s in stored:
            s.file = file
            s.superseded = _superseded(s, recorded, keep)
            result.superseded += s.superseded
            if timeline == "all" or not s.superseded:
                result.rollouts.append(s)
    return result
