"""`RunCheckpoints`: where a run resumes from, saving and restoring a whole run (the driver's state, then the
learner's arrays, the completion marker last: `marin_rl.learner.checkpoint`) in the run's checkpoint directories
(`marin_rl.checkpoint_dirs`), the state before the first checkpoint that a rollback returns to, and the policy's
Hugging Face exports."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from marin_rl.checkpoint_dirs import latest_checkpoint, prune_checkpoints, write_json
from marin_rl.config import RunConfig
from marin_rl.orchestrator.backends import Backend
from marin_rl.orchestrator.preflight import RunRefused
from marin_rl.orchestrator.run_state import RUN_STATE_FILE, read_run_state

logger = logging.getLogger("marin_rl")


class RunCheckpoints:
    """The checkpoints of the run of `config` under `config.checkpoint_dir`, written and read through its
    components `parts` (the learner, the rollout controller, `begin_checkpoint`)."""

    def __init__(self, config: RunConfig, parts: Backend):
        self.config = config
        self.parts = parts
        self.last_saved_step: int | None = None
        """The step of the checkpoint this process saved or restored last (None: none since the run's start)."""
        self.initial_state: dict[str, Any] | None = None
        """The driver's state before step 1, where a learner that dies before the first checkpoint returns."""

    def latest(self) -> str | None:
        """The latest complete checkpoint (None: there is none)."""
        return latest_checkpoint(self.config.checkpoint_dir)

    def find_resume(self) -> str | None:
        """The checkpoint to resume from (None: start fresh); refuses to mix runs when resuming is off."""
        latest = self.latest()
        if latest is not None and not self.config.checkpoint.resume:
            raise RunRefused(
                f"checkpoint.resume is false but {self.config.checkpoint_dir} already holds checkpoints (latest: "
                f"{latest}); set checkpoint.resume: true to continue that run, or choose another output_dir or "
                "checkpoint.path"
            )
        return latest

    def save(self, step: int, run_state: dict[str, Any]) -> float:
        """Checkpoint the run at `step` with the driver's `run_state` (no learner step may be in flight); returns
        seconds taken. The driver's state is written first, then the learner's arrays, whose completion marker comes
        last; then incomplete leftovers and checkpoints beyond `checkpoint.keep` are deleted."""
        start = time.time()
        root = self.config.checkpoint_dir
        path = self.parts.begin_checkpoint(root, step)
        self.parts.rollouts.flush()  # every group the checkpoint counts as accepted is in the rollout files first
        write_json(path, RUN_STATE_FILE, run_state)
        self.parts.learner.run("save_checkpoint", path, step)
        prune_checkpoints(root, self.config.checkpoint.keep)
        self.last_saved_step = step
        self.initial_state = None  # a dead learner now returns to this checkpoint
        seconds = time.time() - start
        logger.info("checkpoint: saved step %d to %s in %.1fs", step, path, seconds)
        return seconds

    def restore(self, path: str) -> dict[str, Any]:
        """Load the learner from the complete checkpoint at `path` and return the driver's state to set (checked
        first: `read_run_state`)."""
        state = read_run_state(path, list(self.parts.pools))
        step = int(state["step"])
        version = self.parts.learner.run("load_checkpoint", path)
        if version != step:
            raise ValueError(f"checkpoint {path}: the learner is at version {version}, the run at step {step}")
        self.last_saved_step = step
        return state

    def rewind_to_start(self) -> dict[str, Any]:
        """The driver's state before step 1 (`initial_state`), for a learner replaced before the first checkpoint;
        from then on no checkpoint of this timeline counts as saved."""
        self.last_saved_step = None
        return self.initial_state

    def export_hf(self, step: int) -> None:
        """Export the learner's policy at `step` as a Hugging Face checkpoint (`hf_path`)."""
        path = hf_path(self.config, step)
        self.parts.learner.run("export_hf", path)
        logger.info("exported the policy as a Hugging Face checkpoint to %s", path)


def hf_path(config: RunConfig, step: int) -> str:
    """Where the policy of `step` is exported as a Hugging Face checkpoint: `output_dir/hf/step-{step}`."""
    return os.path.join(config.output_dir, "hf", f"step-{step}")
