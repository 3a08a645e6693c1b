"""The teacher's servers of an on-policy distillation run: `teacher.num_servers` policy servers (`ServerActor`, the
run's `inference.backend`) serving the teacher's checkpoint, started before the env actors (which score every group
with them) and stopped with the run. They never receive the student's weights.

`ensure_teacher` makes the teacher first when `teacher.path` holds none and `teacher.recipe` says how (the recipe's
run as a step, its output directory `teacher.path`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import time

import ray

from marin_rl.config import RunConfig
from marin_rl.inference.teacher import teacher_checkpoint
from marin_rl.logs import configure_logging
from marin_rl.orchestrator.actors import ServerActor
from marin_rl.placement import wait_for_actors

logger = logging.getLogger("marin_rl")


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


def teacher_run_config(config: RunConfig, checkpoint: str) -> RunConfig:
    """The run config a teacher server is built from: the run's, its initial policy being the teacher's weights."""
    path = checkpoint if "://" in checkpoint or not os.path.exists(checkpoint) else os.path.abspath(checkpoint)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, init_from_hf=path))


class TeacherServerPool:
    """The teacher's servers and their addresses (`addresses`)."""

    def __init__(self, config: RunConfig, checkpoint: str):
        self.config = config
        self.checkpoint = checkpoint
        served = teacher_run_config(config, checkpoint)
        vllm_checkpoint = served.model.init_from_hf if config.inference.backend == "vllm" else None
        options = config.placement.servers.actor_options("teacher_servers")
        self.actors = [
            ServerActor.options(max_concurrency=4, **options).remote(served, f"teacher-{i}", None, vllm_checkpoint)
            for i in range(config.teacher.num_servers)
        ]
        self.addresses: list[str] = []

    def start(self) -> list[str]:
        """Start every server and wait until it listens (bounded by `placement.wait_timeout_s`); their addresses."""
        t = time.time()
        pending = {"teacher": [(a, a.start.remote()) for a in self.actors]}
        ready = wait_for_actors(
            pending, {"teacher": self.config.placement.servers}, self.config.placement.wait_timeout_s
        )
        self.addresses = list(ready["teacher"])
        logger.info("teacher (%s) served at %s (%.1fs)", self.checkpoint, self.addresses, time.time() - t)
        return self.addresses

    def stop(self) -> None:
        """Stop every server (10 s each at most) and kill its actor."""
        for a in self.actors:
            try:
                ray.get(a.stop.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - stopping anyway
                pass
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001
                pass
        self.actors = []
