"""The learner's processes, driven as one: every call goes to every process (they run the same collectives), and
process 0's answer is the group's."""

from __future__ import annotations

from typing import Any

import ray

from marin_rl.config import RunConfig
from marin_rl.orchestrator.actors import LearnerActor
from marin_rl.orchestrator.launcher import Launcher


class LearnerGroup:
    """`learner.hosts` `LearnerActor`s, one per host, started together (`start`) and called together."""

    def __init__(self, config: RunConfig, vocab_size: int, launcher: Launcher):
        n = config.learner.hosts
        self.actors = [
            LearnerActor.options(max_concurrency=2, **launcher.learner_options(i)).remote(config, vocab_size, i, n)
            for i in range(n)
        ]

    @property
    def primary(self):
        """Process 0."""
        return self.actors[0]

    def start(self) -> list[ray.ObjectRef]:
        """Join the processes in one distributed runtime (several hosts) and build the learner; refs of each
        process's parameter count (ready calls)."""
        coordinator = ray.get(self.primary.coordinator_address.remote()) if len(self.actors) > 1 else None
        return [a.start.remote(coordinator) for a in self.actors]

    def call(self, method: str, *args) -> list[ray.ObjectRef]:
        """Call `method` on every process (the same arguments, shared through the object store once)."""
        args = tuple(ray.put(a) if len(self.actors) > 1 and not isinstance(a, (int, str)) else a for a in args)
        return [getattr(a, method).remote(*args) for a in self.actors]

    def run(self, method: str, *args) -> Any:
        """Call `method` on every process, wait for all of them, and return process 0's result."""
        return ray.get(self.call(method, *args))[0]

    def kill(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:
                pass
