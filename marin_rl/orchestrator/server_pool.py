"""The inference servers of a run: starting them where the placement says, broadcasting weights, replacing a dead one.

A server dies with its process or its node. `ServerPool` notices when a weight update or a health check gets
`RayActorError`, starts a replacement with the same placement (it may wait for a node to come back, at most
`placement.wait_timeout_s`), re-sends the latest weights before it serves, and reports the new address list so
the env actors send requests to it.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from marin_rl.broadcast.base import WeightUpdate
from marin_rl.config import RunConfig
from marin_rl.orchestrator.actors import ServerActor
from marin_rl.orchestrator.launcher import Launcher
from marin_rl.orchestrator.restarts import RestartBudget
from marin_rl.placement import wait_for_actors

logger = logging.getLogger("marin_rl")


class ServerPool:
    """`inference.num_servers` `ServerActor`s and their addresses; restarts the dead ones."""

    def __init__(self, config: RunConfig, launcher: Launcher, control_secret: str):
        self.config = config
        self.launcher = launcher
        self.control_secret = control_secret
        self.actors = [self._spawn(i) for i in range(config.inference.num_servers)]
        self.addresses: list[str] = []
        self.last_update: WeightUpdate | None = None
        self.budget = RestartBudget("inference servers", config.orchestrator.max_restarts_per_role)
        self._stats_refs: list = []

    def _spawn(self, index: int):
        options = self.launcher.server_options(index)
        return ServerActor.options(max_concurrency=4, **options).remote(
            self.config, f"server-{index}", self.control_secret
        )

    def ready_calls(self) -> list:
        """(actor, ready ref) per server, for `wait_for_actors` (the ref yields the server's address)."""
        return [(s, s.get_address.remote()) for s in self.actors]

    @property
    def restarts(self) -> int:
        """Servers replaced by this driver."""
        return self.budget.spent

    @property
    def start_timeout_s(self) -> float:
        """How long a server may take to be placed and start serving."""
        return max(self.config.placement.wait_timeout_s, self.config.inference.startup_timeout_s)

    def broadcast(self, update: WeightUpdate) -> list[dict]:
        """Apply `update` on every server (a dead one is replaced and gets it); returns each server's apply stats."""
        self.last_update = update
        refs = [s.apply_update.remote(update) for s in self.actors]
        results = []
        for i, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except RayActorError as e:
                logger.error("inference server %d died (%s); replacing it", i, type(e).__name__)
                results.append(self.restart(i))
        return results

    def check(self, timeout_s: float = 10.0) -> bool:
        """Ask every server for its address; replace those that are dead. Returns whether any was replaced."""
        refs = [s.get_address.remote() for s in self.actors]
        replaced = False
        for i, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=timeout_s)
            except (RayActorError, GetTimeoutError) as e:
                logger.error("inference server %d does not answer (%s); replacing it", i, type(e).__name__)
                self.restart(i)
                replaced = True
        return replaced

    def restart(self, index: int) -> dict:
        """Replace server `index`: start a new one where the placement allows, wait until it serves, send it the
        latest weights. A replacement that dies while starting (e.g. placed on a node that is dying too) is
        replaced again until `placement.wait_timeout_s` passes. Raises `RestartLimitExceeded` once the servers
        used up `orchestrator.max_restarts_per_role`. Returns the weight update's stats (empty when no
        weights were published yet)."""
        self.budget.spend(f"inference server {index}")
        t = time.time()
        deadline = t + self.start_timeout_s
        while True:
            try:
                ray.kill(self.actors[index])
            except Exception:  # already gone with its node
                pass
            self.actors[index] = self._spawn(index)
            try:
                ready = wait_for_actors(
                    {"servers": [(self.actors[index], self.actors[index].get_address.remote())]},
                    {"servers": self.config.placement.servers},
                    max(1.0, deadline - time.time()),
                )
                self.addresses[index] = ready["servers"][0]
                result = {}
                if self.last_update is not None:
                    result = ray.get(self.actors[index].apply_update.remote(self.last_update))
                break
            except RayActorError as e:
                if time.time() >= deadline:
                    raise
                logger.warning(
                    "replacement of inference server %d died while starting (%s); trying again", index, type(e).__name__
                )
                time.sleep(1.0)
        logger.info(
            "inference server %d replaced at %s with version %s (%.1fs)",
            index,
            self.addresses[index],
            None if self.last_update is None else self.last_update.version,
            time.time() - t,
        )
        return result

    def stats(self) -> dict[str, float]:
        """The servers' numeric counters as metrics (`servers/<i>/<counter>`, plus `servers/restarts`), from the
        answers to the previous call's requests that have arrived; asks again. Never waits."""
        out: dict[str, float] = {"servers/restarts": float(self.restarts)}
        for i, ref in enumerate(self._stats_refs):
            if i >= len(self.actors) or not ray.wait([ref], timeout=0)[0]:
                continue
            try:
                answer = ray.get(ref)
            except RayActorError:  # replaced meanwhile; the next health check or broadcast notices
                continue
            for key, value in answer.items():
                if isinstance(value, (bool, int, float)) and not key.endswith("_pid"):
                    out[f"servers/{i}/{key}"] = float(value)
        self._stats_refs = [s.stats.remote() for s in self.actors]
        return out

    def stop(self) -> None:
        """Stop every server (10 s each at most) and kill its actor."""
        for s in self.actors:
            try:
                ray.get(s.stop.remote(), timeout=10)
            except Exception:
                pass
            try:
                ray.kill(s)
            except Exception:
                pass
