"""The checkpoint directories of a run: `{root}/step-{N}/` (a local path or any fsspec URL such as `gs://`), how one
is prepared for writing, which is the newest complete one, and which are pruned.

What goes into a directory is written by its owners: the driver's state (`marin_rl.orchestrator.run_state`) and the
learner's (`marin_rl.learner.checkpoint`), whose `metadata.json` (Levanter's completion marker, written only after
every array is committed) comes last. A directory without the marker is a checkpoint whose writer died:
`latest_checkpoint` (Levanter's `discover_latest_checkpoint`) never returns it, and `prune_checkpoints` deletes it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import fsspec
import jax
from jax.experimental import multihost_utils
from levanter.checkpoint import discover_latest_checkpoint

logger = logging.getLogger(__name__)

MARKER_FILE = "metadata.json"
"""Levanter's completion marker: present only in checkpoints whose every file was written."""
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_path(root: str, step: int) -> str:
    """The directory of the checkpoint at `step` under `root`."""
    return os.path.join(root, f"step-{int(step)}")


def _fs(path: str):
    fs, plain = fsspec.core.url_to_fs(path)
    return fs, plain


def is_complete(path: str) -> bool:
    """Whether `path` is a checkpoint that was completely written (it has Levanter's completion marker)."""
    fs, plain = _fs(path)
    return fs.exists(os.path.join(plain, MARKER_FILE))


def checkpoint_step(path: str) -> int:
    """The step recorded in a complete checkpoint's marker."""
    with fsspec.open(os.path.join(path, MARKER_FILE), "r") as f:
        return int(json.load(f)["step"])


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under `root` (Levanter's discovery: directories with a completion marker,
    highest step, then newest timestamp), or None. Incomplete directories are ignored."""
    fs, plain = _fs(root)
    if not fs.exists(plain):
        return None
    return discover_latest_checkpoint(root)


def _list_steps(root: str) -> list[tuple[int, str, bool]]:
    """(step, path, complete) of every `step-N` directory under `root`, by step."""
    fs, plain = _fs(root)
    if not fs.exists(plain):
        return []
    out = []
    for entry in fs.ls(plain, detail=False):
        name = os.path.basename(entry.rstrip("/"))
        m = _STEP_DIR.match(name)
        if m and fs.isdir(entry):
            path = step_path(root, int(m.group(1)))
            out.append((int(m.group(1)), path, is_complete(path)))
    return sorted(out)


def begin_checkpoint(root: str, step: int) -> str:
    """Prepare `{root}/step-{step}` for writing (an incomplete leftover of a dead process is removed first). In a
    multi-host learner every process may call it: process 0 prepares the directory and the others wait for it, so no
    process removes what another has already written."""
    path = step_path(root, step)
    if jax.process_index() == 0:
        fs, plain = _fs(path)
        if fs.exists(plain):
            fs.rm(plain, recursive=True)
        fs.makedirs(plain, exist_ok=True)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"marin_rl: checkpoint directory {path} prepared")
    return path


def write_json(path: str, name: str, obj: Any) -> None:
    """Write `obj` as JSON to `path/name` (fsspec)."""
    with fsspec.open(os.path.join(path, name), "w") as f:
        json.dump(obj, f)


def read_json(path: str, name: str) -> Any:
    """Read `path/name` as JSON (fsspec)."""
    with fsspec.open(os.path.join(path, name), "r") as f:
        return json.load(f)


def prune_checkpoints(root: str, keep: int | None) -> list[str]:
    """Delete incomplete checkpoint directories and all but the newest `keep` complete ones (None: keep all).

    Call only after a save completed (an incomplete directory is then a dead writer's). Returns the deleted paths.
    """
    entries = _list_steps(root)
    complete = [p for _, p, ok in entries if ok]
    doomed = [p for _, p, ok in entries if not ok]
    if keep is not None and len(complete) > keep:
        doomed += complete[: len(complete) - keep]
    for p in doomed:
        fs, plain = _fs(p)
        fs.rm(plain, recursive=True)
        logger.info("checkpoint: deleted %s", p)
    return doomed
