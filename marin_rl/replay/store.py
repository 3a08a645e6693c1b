"""Rollout persistence: accepted rollouts appended to Parquet files through fsspec (local path or gs://).

One row per rollout, with an explicit Arrow schema (`ROLLOUT_SCHEMA`); nothing is pickled. Free-form rollout
metadata is stored as a JSON string. A writer buffers rows and writes one new file per flush,
`part-<start time>-<writer id>-<sequence>.parquet`, so files are never rewritten and concurrent writers never
collide. `read_rollouts` reads a file or a directory tree back, validating each row, and reports files it cannot
read instead of failing.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from marin_rl.types import Rollout, RolloutFormatError

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 2
"""Bumped whenever `ROLLOUT_SCHEMA` changes incompatibly. Version 1 named the turns' `sampler_logprobs` field
`logprobs`; `read_rollouts` reads both."""

OPTIONAL_COLUMNS = ("token_advantages",)
"""Columns added without a version bump: files written before them lack them and read as None."""

_META = pa.struct(
    [
        ("server", pa.string()),
        ("model", pa.string()),
        ("temperature", pa.float64()),
        ("max_tokens", pa.int64()),
        ("version_start", pa.int64()),
        ("version_end", pa.int64()),
        ("token_versions", pa.list_(pa.int64())),
        ("finish_reason", pa.string()),
        ("latency_s", pa.float64()),
    ]
)
_TURN = pa.struct(
    [
        ("role", pa.string()),
        ("message", pa.string()),
        ("token_ids", pa.list_(pa.int32())),
        ("sampler_logprobs", pa.list_(pa.float64())),
        ("reward", pa.float64()),
        ("rewards", pa.map_(pa.string(), pa.float64())),
        ("inference_metadata", _META),
        ("timestamp", pa.float64()),
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


@dataclass
class ReadResult:
    """Rollouts read from a path, and the files that could not be read (path, reason)."""

    rollouts: list[StoredRollout] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


def rollout_to_row(
    rollout: Rollout, group_id: str, advantage: float, accepted_at: float, token_advantages=None
) -> dict[str, Any]:
    """The Parquet row of a rollout (plain Python values matching `ROLLOUT_SCHEMA`); `token_advantages`: per-token
    advantages, when the estimator gives them."""
    turns = []
    for t in rollout.turns:
        turns.append(
            {
                "role": t.role,
                "message": t.message,
                "token_ids": list(t.token_ids),
                "sampler_logprobs": None if t.sampler_logprobs is None else list(t.sampler_logprobs),
                "reward": float(t.reward),
                "rewards": list(t.rewards.items()),
                "inference_metadata": None if t.inference_metadata is None else vars(t.inference_metadata).copy(),
                "timestamp": float(t.timestamp),
            }
        )
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


def read_rollouts(path: str) -> ReadResult:
    """Every rollout stored at `path` (file or directory); unreadable files are listed in `errors`, not raised."""
    fs, _ = fsspec.core.url_to_fs(path)
    result = ReadResult()
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
        result.rollouts.extend(stored)
    return result
