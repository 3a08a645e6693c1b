"""The teacher's servers of an on-policy distillation run: `teacher.num_servers` policy servers (`ServerActor`, the
run's `inference.backend`) serving the teacher's checkpoint, started before the env actors (which score every group
with them) and stopped with the run. They never receive the student's weights.

`ensure_teacher` (`marin_rl.orchestrator.teacher_recipe`, which imports no Ray) makes the teacher first when
`teacher.path` holds none."""

from __future__ import annotations

import logging
import time

from marin_rl.config import RunConfig
from marin_rl.gguf import hf_directory
from marin_rl.orchestrator.ray_backend.actors import ServerActor
from marin_rl.orchestrator.restarts import stop_actors
from marin_rl.orchestrator.teacher_recipe import teacher_run_config
from marin_rl.placement import wait_for_actors

logger = logging.getLogger("marin_rl")


class TeacherServerPool:
    """The teacher's servers and their addresses (`addresses`)."""

    def __init__(self, config: RunConfig, checkpoint: str):
        self.config = config
        self.checkpoint = checkpoint
        served = teacher_run_config(config, checkpoint)
        vllm_checkpoint = None
        if config.inference.backend == "vllm":
            vllm_checkpoint = hf_directory(served.model.init_from_hf)  # vLLM reads the directory a GGUF file makes
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
        stop_actors(self.actors)
        self.actors = []
