"""Run checkpoints: the learner's arrays through Levanter's checkpointer, the driver's state as JSON beside them.

Layout of one checkpoint, `{root}/step-{N}/` (local path or any fsspec URL such as `gs://`):

* `run_state.json` — the driver's state: replay buffers, batcher, problem iterators, counters (written first);
* `learner.json` — the learner's version, optimizer step count and whether it holds a reference model;
* the arrays of `Learner.state()`, a `TrainState` (policy, optimizer state, reference model, counters, critic), as
  TensorStore under its field names, written by `levanter.checkpoint.save_checkpoint`;
* `metadata.json` — Levanter's completion marker, written by the checkpointer's commit callback only after every
  array is committed, and so after everything above.

A directory without `metadata.json` is a checkpoint whose writer died: `latest_checkpoint` (Levanter's
`discover_latest_checkpoint`) never returns it, and the next save deletes it. Saves are synchronous.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import equinox as eqx
import fsspec
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from levanter.checkpoint import discover_latest_checkpoint, load_checkpoint, save_checkpoint

from marin_rl.learner.config import MESH_AXES
from marin_rl.learner.distributed import is_primary
from marin_rl.learner.learner import Learner

logger = logging.getLogger(__name__)

RUN_STATE_FILE = "run_state.json"
"""The driver's state in a checkpoint directory."""
LEARNER_FILE = "learner.json"
"""The learner's scalar state in a checkpoint directory."""
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
    if is_primary():
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


# ---- the learner's part ------------------------------------------------------------------------------------
def save_learner_state(learner: Learner, path: str, step: int) -> None:
    """Write the learner's state into checkpoint directory `path`; its completion marker is written last, so call
    this after every other file of the checkpoint is written. A multi-host learner calls it on every process: each
    writes its shards, process 0 the JSON and (once every shard is committed) the marker."""
    state = learner.state()
    if is_primary():
        write_json(
            path,
            LEARNER_FILE,
            {
                "version": learner.version,
                "optimizer_steps": learner.optimizer_steps,
                "has_reference": state.has_reference,
                "has_critic": state.has_critic,
            },
        )
    save_checkpoint(state, step, path, is_temporary=False)


def load_learner_state(learner: Learner, path: str) -> None:
    """Load the learner's state from the complete checkpoint at `path` (arrays placed like the learner's own)."""
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER_FILE})")
    info = read_json(path, LEARNER_FILE)
    if bool(info.get("has_critic", False)) != (learner.critic is not None):
        raise ValueError(
            f"checkpoint {path} was written {'with' if info.get('has_critic') else 'without'} a critic, "
            f"but learner.critic.enabled is {learner.critic is not None}"
        )
    template = learner.state_template(bool(info["has_reference"]))
    mesh = learner.mesh
    if mesh is None:  # the checkpointer places arrays on a mesh: a one-device one here
        mesh = Mesh(np.asarray(jax.devices()[:1], dtype=object).reshape(1, 1, 1), MESH_AXES)
    # Levanter warns about every non-array leaf of the template (None fields of the model); nothing is wrong.
    quiet = logging.getLogger("levanter.tensorstore_serialization")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        state = load_checkpoint(template, path, axis_mapping=learner.config.mesh.param_axis_mapping, mesh=mesh)
    finally:
        quiet.setLevel(level)
    if learner.mesh is None:
        # uncommitted default-device arrays, like a fresh learner's, so its compiled steps are reused as they are
        state = jax.tree_util.tree_map(lambda x: jax.device_put(np.asarray(x)) if eqx.is_array(x) else x, state)
    learner.load_state(state)
    if learner.version != int(info["version"]):
        raise ValueError(f"checkpoint {path}: learner.json says version {info['version']}, arrays {learner.version}")
