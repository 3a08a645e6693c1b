"""Rollout persistence: accepted rollouts appended to Parquet files through fsspec (local path or gs://).

One row per rollout, with an explicit Arrow schema (`ROLLOUT_SCHEMA`); nothing is pickled. Free-form rollout
metadata is stored as a JSON string. A writer buffers rows and writes one new file per flush,
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
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import fsspec
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
`teacher_logprobs`, `teacher_top_ids` and `teacher_top_logprobs`, fields of the turn struct added the same way)."""

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
        *_TURN_LISTS.items(),  # the teacher's, added later (`TURN_TOKEN_LISTS`)
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
        self._rows: list[dict[str, Any]] = []
        self._last_flush = time.time()
        self._prefix = f"part-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self._seq = 0
        self.rows_written = 0
        self.files_written: list[str] = []

    def append(self, rows: list[dict[str, Any]]) -> None:
        """Queue rows; writes a file once `flush_rows` rows or `flush_interval_s` seconds have accumulated."""
        self._rows.extend(rows)
        if len(self._rows) >= self.flush_rows or time.time() - self._last_flush >= self.flush_interval_s:
            self.flush()

    def flush(self) -> str | None:
        """Write the queued rows to a new Parquet file; returns its path (None when nothing was queued)."""
        self._last_flush = time.time()
        if not self._rows:
            return None
        table = pa.Table.from_pylist(self._rows, schema=ROLLOUT_SCHEMA)
        path = f"{self._root}/{self._prefix}-{self._seq:06d}.parquet"
        with self.fs.open(path, "wb") as f:
            pq.write_table(table, f)
        self._seq += 1
        self.rows_written += len(self._rows)
        self._rows = []
        self.files_written.append(path)
        return path

    def close(self) -> None:
        """Flush what is queued (safe to call more than once)."""
        try:
            self.flush()
        except Exception:  # at interpreter exit: report, never raise
            logger.exception("rollout writer: could not flush %d rows to %s", len(self._rows), self.directory)


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
