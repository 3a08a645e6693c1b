"""The inference servers of a run: starting them where the placement says, broadcasting weights, replacing a dead one.

A server dies with its process or its node. `ServerPool` notices when a weight update or a health check gets
`RayActorError`, starts a replacement with the same placement (it may wait for a node to come back, at most
`placement.wait_timeout_s`; then `inference.startup_timeout_s` to start serving), re-sends the latest weights
before it serves, and reports the new address list so the env actors send requests to it.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from marin_rl.broadcast.base import UpdateUnavailable, WeightUpdate
from marin_rl.config import RunConfig
from marin_rl.model.lora import MissingBaseError
from marin_rl.orchestrator.ray_backend.actors import ServerActor
from marin_rl.orchestrator.ray_backend.launcher import Launcher
from marin_rl.orchestrator.restarts import RestartBudget, kill_quietly, start_replacement, stop_actors

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
        self.needs_base = False
        """A replacement server got adapters only (LoRA) and knows no base: the next publish must be a full one."""
        self.needs_weights = False
        """A replacement server could not fetch the latest update (its learner died and the arrays went with it):
        it serves the initial policy until the learner publishes again."""
        self.budget = RestartBudget("inference servers", config.orchestrator.max_restarts_per_role)
        self._stats_refs: list = []

    def _spawn(self, index: int):
        options = self.launcher.server_options(index)
        return ServerActor.options(max_concurrency=4, **options).remote(
            self.config, f"server-{index}", self.control_secret
        )

    def ready_calls(self) -> list:
        """(actor, ready ref) per server, for `wait_for_actors`: each server starts serving (the ref yields its
        address)."""
        return [(s, s.start.remote()) for s in self.actors]

    @property
    def restarts(self) -> int:
        """Servers replaced by this driver."""
        return self.budget.spent

    @property
    def startup(self) -> tuple[float, str]:
        """How long a placed server may take to start serving, and the setting that says so (for `wait_for_actors`)."""
        return self.config.inference.startup_timeout_s, "inference.startup_timeout_s"

    def broadcast(self, update: WeightUpdate) -> list[dict]:
        """Apply `update` on every server (a dead one is replaced and gets it); returns each server's apply stats
        (empty for a server that could not fetch it: its arrays went with the learner that published them, and
        `needs_weights` asks for the learner's next publish)."""
        self.last_update = update
        refs = [s.apply_update.remote(update) for s in self.actors]
        results = []
        for i, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except RayActorError as e:
                logger.error("inference server %d died (%s); replacing it", i, type(e).__name__)
                results.append(self.restart(i))
            except RayTaskError as e:
                if not isinstance(e.cause, UpdateUnavailable):
                    raise
                self._lacks_weights(i, e.cause)
                results.append({})
        return results

    def _lacks_weights(self, index: int, cause: UpdateUnavailable) -> None:
        """Server `index` could not fetch the latest update (its arrays went with the learner that published them):
        the next publish is for it (`needs_weights`)."""
        logger.warning(
            "inference server %d could not fetch version %d (%s); the learner publishes again",
            index,
            self.last_update.version,
            str(cause).splitlines()[0][:200],
        )
        self.needs_weights = True

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
        """Replace server `index`: start a new one where the placement allows (`start_replacement`: at most
        `placement.wait_timeout_s` to be placed, then `inference.startup_timeout_s` to serve), send it the latest
        weights. Raises `PlacementError` when no node can take it in time, `RestartLimitExceeded` once the servers
        used up `orchestrator.max_restarts_per_role`. Returns the weight update's stats (empty when no weights were
        published yet)."""
        self.budget.spend(f"inference server {index}")
        t = time.time()
        kill_quietly(self.actors[index])
        self.actors[index], self.addresses[index] = start_replacement(
            f"inference server {index}",
            "servers",
            lambda: self._spawn(index),
            lambda actor: actor.start.remote(),
            self.config.placement.servers,
            self.config.placement.wait_timeout_s,
            self.startup,
        )
        result = {}
        if self.last_update is not None:
            try:
                result = ray.get(self.actors[index].apply_update.remote(self.last_update))
            except RayActorError as e:  # its node died too
                logger.error("the replacement of inference server %d died (%s); replacing it", index, type(e).__name__)
                return self.restart(index)
            except RayTaskError as e:
                if isinstance(e.cause, MissingBaseError):
                    logger.info(
                        "inference server %d was replaced mid-run with LoRA: the next publish carries the base", index
                    )
                    self.needs_base = True
                elif isinstance(e.cause, UpdateUnavailable):
                    self._lacks_weights(index, e.cause)
                else:
                    raise
        logger.info(
            "inference server %d replaced at %s with version %s (%.1fs)",
            index,
            self.addresses[index],
            None if self.last_update is None or self.needs_weights else self.last_update.version,
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
        stop_actors(self.actors)
