"""Making the teacher of an on-policy distillation run before the run starts, when `teacher.path` holds none and
`teacher.recipe` says how: the recipe's run as a step (a subprocess), its output directory `teacher.path`; and the run
config a teacher's server is built from (`teacher_run_config`, for the Ray backend's teacher servers and the local
backend's in-process teacher engine). No Ray: `marin_rl.run` imports this on every backend."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import time

from marin_rl.config import RunConfig
from marin_rl.inference.teacher import teacher_checkpoint
from marin_rl.logs import configure_logging

logger = logging.getLogger("marin_rl")


def teacher_run_config(config: RunConfig, checkpoint: str) -> RunConfig:
    """The run config a teacher server is built from: the run's, its initial policy being the teacher's weights."""
    path = checkpoint if "://" in checkpoint or not os.path.exists(checkpoint) else os.path.abspath(checkpoint)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, init_from_hf=path))


def ensure_teacher(config: RunConfig) -> str:
    """The teacher's Hugging Face checkpoint (`teacher_checkpoint` of `teacher.path`). When the path holds none and
    `teacher.recipe` is set, the recipe runs first (`python -m marin_rl.run --config RECIPE --output_dir PATH`, its
    progress on this console); FileNotFoundError when there is still none."""
    teacher = config.teacher
    found = teacher_checkpoint(teacher.path, local=bool(teacher.recipe))
    if found is None and teacher.recipe:
        configure_logging()  # before the run's own: this step comes first
        logger.info("teacher: no checkpoint at %s; making it with %s first", teacher.path, teacher.recipe)
        start = time.time()
        command = [sys.executable, "-m", "marin_rl.run", "--config", teacher.recipe, "--output_dir", teacher.path]
        done = subprocess.run(command, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"teacher: the recipe {teacher.recipe} failed (exit status {done.returncode})")
        logger.info("teacher: made in %.0fs at %s", time.time() - start, teacher.path)
        found = teacher_checkpoint(teacher.path, local=True)
    if found is None:
        raise FileNotFoundError(
            f"teacher.path {teacher.path}: no Hugging Face checkpoint (config.json) or hf/step-N export there"
            + ("" if teacher.recipe else "; set teacher.recipe to an experiment that makes one")
        )
    return found
