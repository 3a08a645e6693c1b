"""Replacing dead actors: how many of one role (the inference servers; the env actors of one environment) the driver
replaces before it stops the run (replacing rides out a lost node, but an actor that dies again and again is a bug or
a broken machine, and replacing it forever would hide that), and how a replacement is started and awaited.

A replacement has `placement.wait_timeout_s` to be placed, whether its node is being restarted or a new node has to
join; replacements placed on a node that is dying too are started again within that time. Once placed, it has its
role's start-up limit. Past the wait, the run fails with a `PlacementError` naming the resource no live node offers
and the node lost with it (`marin_rl.placement.wait_for_actors`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from marin_rl.placement import PlacementError, RoleResources, cluster_nodes, lost_placement, wait_for_actors

if TYPE_CHECKING:
    import ray

logger = logging.getLogger("marin_rl")


class RestartLimitExceeded(RuntimeError):
    """An actor died after its role had used up `orchestrator.max_restarts_per_role`."""


class RestartBudget:
    """Counts the replacements of one role's actors in this driver process; the one past the limit raises."""

    def __init__(self, role: str, limit: int):
        self.role = role
        self.limit = limit
        self.spent = 0

    def spend(self, what: str) -> None:
        """Account for replacing `what`, or raise `RestartLimitExceeded` when the role has none left."""
        if self.spent >= self.limit:
            raise RestartLimitExceeded(
                f"{what} died, and the {self.role} were already replaced {self.spent} times by this driver "
                f"(orchestrator.max_restarts_per_role={self.limit}); stopping rather than replacing it again. Look "
                "for the cause in its log above; rerunning the command resumes from the latest checkpoint."
            )
        self.spent += 1


def kill_quietly(actor: Any) -> None:
    """Kill `actor`; nothing to do when it is already gone (with its node)."""
    import ray  # the local backend's driver imports this module without Ray

    try:
        ray.kill(actor)
    except Exception:
        pass


def stop_actors(actors: list, timeout_s: float = 10.0) -> None:
    """Ask each server actor to `stop` (at most `timeout_s` each), then kill it; one that is gone or does not answer
    is killed anyway."""
    import ray

    for actor in actors:
        try:
            ray.get(actor.stop.remote(), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - stopping anyway
            pass
        kill_quietly(actor)


def start_replacement(
    what: str,
    role: str,
    spawn: Callable[[], Any],
    ready: Callable[[Any], ray.ObjectRef],
    request: RoleResources,
    wait_timeout_s: float,
    startup: tuple[float, str] | None = None,
) -> tuple[Any, Any]:
    """Start a replacement for `what` (e.g. 'inference server 0') with `spawn()` and wait until `ready(actor)`
    answers; returns (the actor, the answer).

    `role` ('servers', 'envs', ...) and `request` name it in errors. The replacement has `wait_timeout_s`
    (`placement.wait_timeout_s`) from now to be placed; one that dies before it answers (placed on a node that is
    dying too) is started again while that time lasts. Once placed, it has `startup` = (seconds, setting) to answer
    (default: `wait_timeout_s`). Raises `PlacementError` when it is not placed in time (naming the resource no live
    node offers and the node lost with it) or keeps dying; the `RayActorError` of a replacement whose constructor
    raised at once. A replacement that did not start is killed, so that stopping the run does not wait for it.
    """
    from ray.exceptions import RayActorError

    began = time.time()
    while True:
        actor = spawn()
        try:
            answer = wait_for_actors(
                {role: [(actor, ready(actor))]},
                {role: request},
                wait_timeout_s,
                None if startup is None else {role: startup},
                since=began,
            )
            return actor, answer[role][0]
        except RayActorError as e:
            kill_quietly(actor)
            if e.actor_init_failed:  # its constructor raised: a bug or a bad config, not a lost node
                raise
            if time.time() >= began + wait_timeout_s:
                why = lost_placement(role, request, cluster_nodes())
                raise PlacementError(
                    f"{what}: its replacements kept dying while starting for placement.wait_timeout_s="
                    f"{wait_timeout_s:g}s ({type(e).__name__})" + (f"; {why}" if why else "")
                ) from e
            logger.warning("the replacement of %s died while starting (%s); starting another", what, type(e).__name__)
            time.sleep(1.0)
        except BaseException:
            kill_quietly(actor)
            raise
