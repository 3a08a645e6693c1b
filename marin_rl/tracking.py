"""Metrics: JSON lines in the output directory, Weights & Biases when enabled, a console line, and the report."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from levanter.tracker.tracker import CompositeTracker, Tracker

logger = logging.getLogger("marin_rl")


def _jsonable(v: Any):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item"):
        return v.item()
    return v


class JsonlTracker(Tracker):
    """Writes one JSON object per `log` call to `path` (local or any fsspec URL).

    A fresh run starts the file. A resumed run (`resume_step` = the checkpoint's step) keeps everything already in
    it, drops only a line cut off by a crash, and appends a `{"resume": {"step", "checkpoint", "time"}}` line; rows
    logged afterwards for steps above `resume_step` supersede those the lost process logged (see `read_metrics`).
    `history` holds the effective per-step rows (for the report).
    """

    name = "jsonl"

    def __init__(self, path: str, resume_step: int | None = None, resume_path: str | None = None):
        self.path = path
        fs, p = fsspec.core.url_to_fs(path)
        fs.makedirs(os.path.dirname(p), exist_ok=True)
        self.history: list[dict[str, Any]] = []
        prefix = ""
        if resume_step is not None:
            if fs.exists(p):
                text = fs.cat_file(p).decode("utf-8")
                prefix = text[: text.rfind("\n") + 1]  # a line the dead process did not finish is dropped
                self.history = [r for r in effective_rows(prefix.splitlines()) if r["step"] <= resume_step]
            marker = {"resume": {"step": resume_step, "checkpoint": resume_path, "time": time.time()}}
            prefix += json.dumps(marker) + "\n"
        if isinstance(fs, LocalFileSystem) and prefix:
            tmp = p + ".tmp"  # rewrite by rename, so a crash meanwhile loses nothing
            with open(tmp, "w") as f:
                f.write(prefix)
            os.replace(tmp, p)
            self._file = open(p, "a")
        else:  # object stores replace the object only when the new one is closed
            self._file = fsspec.open(path, "w").open()
            if prefix:
                self._file.write(prefix)
                self._file.flush()

    def log_hyperparameters(self, hparams: dict[str, Any]):
        self._write({"hparams": hparams})

    def log(self, metrics, *, step, commit=None):
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self.history.append(row)
        self._write(row)

    def log_summary(self, metrics: dict[str, Any]):
        self._write({"summary": {k: _jsonable(v) for k, v in metrics.items()}})

    def log_artifact(self, artifact_path, *, name=None, type=None):
        pass

    def _write(self, obj: dict) -> None:
        self._file.write(json.dumps(obj, default=str) + "\n")
        self._file.flush()

    def finish(self):
        self._file.close()


def effective_rows(lines: list[str]) -> list[dict[str, Any]]:
    """The per-step rows of a metrics log, as the run that finished sees them: after a `resume` line at step N,
    rows logged earlier for steps above N (by a process that died after its last checkpoint) are dropped.
    Lines that are not complete JSON objects (cut off by a crash) are skipped."""
    rows: list[dict[str, Any]] = []
    for line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict):
            continue
        if "resume" in obj:
            rows = [r for r in rows if r["step"] <= obj["resume"]["step"]]
        elif "step" in obj:
            rows.append(obj)
    return rows


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The effective per-step rows of the metrics log at `path` (local or fsspec URL); see `effective_rows`."""
    with fsspec.open(path, "r") as f:
        return effective_rows(f.read().splitlines())


def make_tracker(
    output_dir: str,
    wandb_mode: str,
    project: str,
    run_name: str,
    resume_step: int | None = None,
    resume_path: str | None = None,
) -> tuple[Tracker, JsonlTracker]:
    """The composite tracker for a run and its JSON-lines member (which keeps the history for the report).

    `resume_step` / `resume_path`: the run continues from that checkpoint; the metrics log is appended to.
    """
    jsonl = JsonlTracker(os.path.join(output_dir, "metrics.jsonl"), resume_step, resume_path)
    trackers: list[Tracker] = [jsonl]
    if wandb_mode != "disabled":
        from levanter.tracker.wandb import WandbConfig

        os.environ.setdefault("WANDB_DIR", output_dir if "://" not in output_dir else ".")
        trackers.append(WandbConfig(project=project, name=run_name, mode=wandb_mode, save_code=False).init(None))
    return CompositeTracker(trackers), jsonl


def console_line(step: int, m: dict[str, Any], env_names: list[str]) -> str:
    """One human-readable line per learner step."""
    parts = [f"step {step:>4}", f"v{int(m.get('learner/version', step))}"]
    for n in env_names:
        r = m.get(f"batches/{n}/reward/mean")
        if r is not None:
            parts.append(f"{n} reward {r:.3f}")
        e = m.get(f"eval/{n}/reward")
        if e is not None:
            parts.append(f"eval {e:.3f}")
    parts.append(f"loss {m.get('learner/loss', float('nan')):+.4f}")
    parts.append(f"gen {m.get('throughput/generated_tokens_per_s', 0):.0f} tok/s")
    parts.append(f"train {m.get('learner/tokens_per_s', 0):.0f} tok/s")
    parts.append(f"stale {m.get('batches/staleness/mean', 0):.2f}/{m.get('batches/staleness/max', 0)}")
    return " | ".join(parts)
