"""The learner's state in a checkpoint directory it is given: its arrays through Levanter's checkpointer, its scalars
as JSON beside them. Where checkpoint directories lie and which one is the latest complete is
`marin_rl.checkpoint_dirs`.

What the learner writes into a directory (local path or any fsspec URL such as `gs://`):

* `learner.json` — the learner's version, optimizer step count and whether it holds a reference model and a critic;
* the arrays of `Learner.state()`, a `TrainState` (policy, optimizer state, reference model, counters, critic), as
  TensorStore under its field names, written by `levanter.checkpoint.save_checkpoint`;
* `metadata.json` — Levanter's completion marker, written by the checkpointer's commit callback only after every
  array is committed, and so after everything above (and after whatever else the caller wrote there first, such as
  the driver's `run_state.json`). Saves are synchronous.
"""

from __future__ import annotations

import logging

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh
from levanter.checkpoint import load_checkpoint, save_checkpoint

from marin_rl.checkpoint_dirs import MARKER_FILE, is_complete, read_json, write_json
from marin_rl.learner.config import MESH_AXES
from marin_rl.learner.distributed import is_primary
from marin_rl.learner.learner import Learner

LEARNER_FILE = "learner.json"
"""The learner's scalar state in a checkpoint directory."""


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
