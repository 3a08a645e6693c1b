"""The learner's processes, driven as one: every call goes to every process (they run the same collectives), and
process 0's answer is the group's. When one process dies the others may wait forever in a collective, so results
are awaited as they come and the first failure is raised at once; the group is then replaced as a whole."""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from marin_rl.config import RunConfig
from marin_rl.orchestrator.ray_backend.actors import LearnerActor
from marin_rl.orchestrator.ray_backend.launcher import Launcher
from marin_rl.placement import wait_for_actors


class LearnerGroup:
    """`learner.hosts` `LearnerActor`s, one per host, started together (`start`) and called together."""

    def __init__(self, config: RunConfig, launcher: Launcher):
        self.config = config
        n = config.learner.hosts
        self.actors = [
            LearnerActor.options(max_concurrency=2, **launcher.learner_options(i)).remote(config, i, n)
            for i in range(n)
        ]

    @property
    def primary(self):
        """Process 0."""
        return self.actors[0]

    def start(self) -> list[ray.ObjectRef]:
        """Join the processes in one distributed runtime (several hosts) and build the learner; refs of each
        process's parameter count (ready calls). Several hosts: process 0 must be placed within
        `placement.wait_timeout_s` to say where the runtime's coordinator is (`PlacementError` otherwise)."""
        coordinator = None
        if len(self.actors) > 1:
            placement = self.config.placement
            coordinator = wait_for_actors(
                {"learner": [(self.primary, self.primary.coordinator_address.remote())]},
                {"learner": placement.learner},
                placement.wait_timeout_s,
            )["learner"][0]
        return [a.start.remote(coordinator) for a in self.actors]

    def call(self, method: str, *args) -> list[ray.ObjectRef]:
        """Call `method` on every process (the same arguments, shared through the object store once)."""
        args = tuple(ray.put(a) if len(self.actors) > 1 and not isinstance(a, (int, str)) else a for a in args)
        return [getattr(a, method).remote(*args) for a in self.actors]

    def run(self, method: str, *args) -> Any:
        """Call `method` on every process, wait for all of them, and return process 0's result (`RayActorError` as
        soon as one process is found dead)."""
        return self.get(self.call(method, *args))[0]

    @staticmethod
    def get(refs: list[ray.ObjectRef]) -> list[Any]:
        """The results of one call on every process, raising the first failure without waiting for the others
        (which may be blocked in a collective with the dead process)."""
        results, pending = {}, list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            results[ready[0]] = ray.get(ready[0])
        return [results[r] for r in refs]

    @staticmethod
    def finished(refs: list[ray.ObjectRef]) -> bool:
        """Whether every process has finished a call, without blocking; raises a finished process's failure."""
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            ray.get(ref)
        return len(ready) == len(refs)

    def owns(self, error: RayActorError, timeout_s: float = 30.0) -> bool:
        """Whether `error` reports the death of one of this group's processes (by its actor id; without one, by
        asking each process whether it is alive)."""
        if error.actor_id is not None:
            return error.actor_id in {a._actor_id.hex() for a in self.actors}
        try:
            ray.get([a.__ray_ready__.remote() for a in self.actors], timeout=timeout_s)
        except RayActorError:
            return True
        except GetTimeoutError:  # alive but busy
            return False
        return False

    def kill(self) -> None:
        """Kill every process (a dead one's peers included: they cannot go on without it)."""
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:
                pass
