"""Metrics: JSON lines in the output directory, Weights & Biases when enabled, a console line, and the report."""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
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

    def mark_resume(self, step: int, checkpoint: str | None) -> None:
        """The run went back to `step` without a new process (its learner was replaced and restored from
        `checkpoint`, None: the start): a resume marker, so rows logged from now on for later steps supersede those
        logged before."""
        self.history = [r for r in self.history if r["step"] <= step]
        self._write({"resume": {"step": step, "checkpoint": checkpoint, "time": time.time()}})

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
        trackers.append(_wandb_tracker(output_dir, wandb_mode, project, run_name, resumed=resume_step is not None))
    return CompositeTracker(trackers), jsonl


def _wandb_tracker(output_dir: str, mode: str, project: str, run_name: str, resumed: bool) -> Tracker:
    """A W&B run whose files go to `$WANDB_DIR` if set, else the run's output directory (local ones; `.` for
    gs://), under the id `wandb_run_id` gives: a resumed run continues its W&B run instead of starting a new one."""
    import wandb
    from levanter.tracker.wandb import WandbTracker

    wandb_dir = os.environ.get("WANDB_DIR") or (output_dir if "://" not in output_dir else ".")
    os.makedirs(wandb_dir, exist_ok=True)
    run_id = wandb_run_id(output_dir, resumed)
    # wandb.init directly rather than Levanter's WandbConfig: it has no `dir`, and W&B reads WANDB_DIR only once per
    # process, so a second run in one process would write into the first one's directory.
    run = wandb.init(
        project=project,
        name=run_name,
        id=run_id,
        resume="allow",
        mode=mode,
        dir=wandb_dir,
        settings=wandb.Settings(save_code=False),
    )
    return WandbTracker(run, minimum_log_step=int(run.step))


WANDB_ID_FILE = "wandb_run_id"


def wandb_run_id(output_dir: str, resumed: bool) -> str:
    """The W&B run id of the run in `output_dir`: a resumed run continues the one recorded in
    `output_dir/wandb_run_id`; a fresh run (or a resumed one that never had W&B on) gets a new id, recorded there."""
    path = os.path.join(output_dir, WANDB_ID_FILE)
    fs, plain = fsspec.core.url_to_fs(path)
    if resumed and fs.exists(plain):
        with fs.open(plain, "r") as f:
            found = f.read().strip()
        if found:
            return found
    run_id = uuid.uuid4().hex[:12]  # W&B ids: letters and digits, unique within the project
    with fs.open(plain, "w") as f:
        f.write(run_id + "\n")
    return run_id


def console_line(step: int, m: dict[str, Any], env_names: list[str]) -> str:
    """One human-readable line per learner step (with an evaluation: each named reward's held-out mean too, when an
    environment has more than one, e.g. a verifier's and a reward model's; the verifier's score first when the
    environment trains on a reward model, see `marin_rl.report`)."""
    parts = [f"step {step:>4}", f"v{int(m.get('learner/version', step))}"]
    for n in env_names:
        r = m.get(f"batches/{n}/reward/mean")
        if r is not None:
            parts.append(f"{n} reward {r:.3f}")
        e = m.get(f"eval/{n}/reward")
        if e is not None:
            prefix = f"eval/{n}/rewards/"
            named = {k[len(prefix) :]: v for k, v in m.items() if k.startswith(prefix)}
            shown = f" ({', '.join(f'{k} {v:.3f}' for k, v in named.items())})" if len(named) > 1 else ""
            verifier = m.get(f"eval/{n}/verifier_reward")
            if verifier is not None:  # trained on a reward model: the verifier's score is the headline
                parts.append(f"eval verifier {verifier:.3f}, trained reward {e:.3f}{shown}")
            else:
                parts.append(f"eval {e:.3f}{shown}")
    parts.append(f"loss {m.get('learner/loss', float('nan')):+.4f}")
    parts.append(f"gen {m.get('throughput/generated_tokens_per_s', 0):.0f} tok/s")
    parts.append(f"train {m.get('learner/tokens_per_s', 0):.0f} tok/s")
    parts.append(f"stale {m.get('batches/staleness/mean', 0):.2f}/{m.get('batches/staleness/max', 0)}")
    return " | ".join(parts)
