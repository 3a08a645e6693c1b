"""Metrics: JSON lines in the output directory, Weights & Biases when enabled, a console line, and the report."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

import fsspec
from levanter.tracker.tracker import CompositeTracker, Tracker

logger = logging.getLogger("marin_rl")


def _jsonable(v: Any):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "item"):
        return v.item()
    return v


class JsonlTracker(Tracker):
    """Appends one JSON object per `log` call to `path` (local or any fsspec URL)."""

    name = "jsonl"

    def __init__(self, path: str):
        self.path = path
        fs, p = fsspec.core.url_to_fs(path)
        fs.makedirs(os.path.dirname(p), exist_ok=True)
        self._file = fsspec.open(path, "w").open()
        self.history: list[dict[str, Any]] = []

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


def make_tracker(output_dir: str, wandb_mode: str, project: str, run_name: str) -> tuple[Tracker, JsonlTracker]:
    """The composite tracker for a run and its JSON-lines member (which keeps the history for the report)."""
    jsonl = JsonlTracker(os.path.join(output_dir, "metrics.jsonl"))
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
