"""The env actors of one environment: the problem order, the groups in flight, replacing a dead actor.

An env actor dies with its process or its node; the driver sees it when one of its groups (or an evaluation) fails
with `RayActorError`, hands the group's problem out again and starts a replacement with the same placement, as
`ServerPool` does for a server: at most `placement.wait_timeout_s` to be placed (a node offering its resources may
have to join), then as long again to start (`marin_rl.orchestrator.restarts.start_replacement`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError, UnserializableException

from marin_rl.config import RunConfig
from marin_rl.envs.difficulty import problem_order
from marin_rl.envs.iteration import ProblemTicket
from marin_rl.orchestrator.ray_backend.actors import EnvActor
from marin_rl.orchestrator.ray_backend.launcher import Launcher
from marin_rl.orchestrator.restarts import RestartBudget, kill_quietly, start_replacement
from marin_rl.placement import wait_for_actors
from marin_rl.rollouts.controller import WorkerPool
from marin_rl.rollouts.staleness import RolloutsPerBatch
from marin_rl.rollouts.worker import GroupResult

logger = logging.getLogger("marin_rl")


class EnvPool(WorkerPool):
    """`envs[index].replicas` env actors, the driver-owned problem order (`ProblemIterator`, or the pass-rate
    sampler of `curriculum.problems`) and the groups in flight.

    `launch(n)` hands out up to `n` problems (each replica runs at most `concurrency` groups at once); `collect()`
    returns the finished groups. Deterministic runs (`orchestrator.deterministic`) sample each group with a seed
    derived from its ticket and collect groups only in hand-out order; a group that fails (or whose actor dies) is
    sampled again with the same seed in its place in that order, so the run goes on as if nothing had failed.
    """

    def __init__(
        self,
        config: RunConfig,
        index: int,
        servers: list[str],
        tokens_per_batch: float,
        launcher: Launcher | None = None,
        reward_servers: dict[str, list[str]] | None = None,
        teacher_servers: list[str] | None = None,
    ):
        super().__init__()
        self.config = config
        self.reward_servers = dict(reward_servers or {})
        """Addresses of the reward models' servers, by model name (for the actors' model rewards)."""
        self.teacher_servers = list(teacher_servers or [])
        """Addresses of the teacher's servers (on-policy distillation), or none."""
        self.launcher = launcher
        self.index = index
        self.env = config.envs[index]
        self.servers = servers
        self.deterministic = config.orchestrator.deterministic
        self.actors = [self._spawn(r) for r in range(self.env.replicas)]
        ready = wait_for_actors(
            {"envs": [(a, a.num_problems.remote()) for a in self.actors]},
            {"envs": config.placement.envs},
            config.placement.wait_timeout_s,
        )
        num_problems = ready["envs"][0]
        self.iterator = problem_order(num_problems, config.orchestrator.seed, self.env.name, config.problem_sampling())
        self.inflight: dict[ray.ObjectRef, tuple[int, ProblemTicket, Any]] = {}
        """ref -> (replica, ticket, actor), in hand-out order."""
        self.to_resample: list[tuple[int, ProblemTicket]] = []
        """Deterministic runs: failed groups (replica, ticket) to start again, at the head of the order."""
        self.batch_size = RolloutsPerBatch(tokens_per_batch, self.env.sampling.max_tokens + 16)
        self.budget = RestartBudget(f"env actors of {self.env.name}", config.orchestrator.max_restarts_per_role)
        self._failures_in_a_row = 0
        self._launched_at: dict[ray.ObjectRef, float] = {}

    @property
    def name(self) -> str:
        """The environment's name."""
        return self.env.name

    @property
    def group_size(self) -> int:
        """Rollouts per group."""
        return self.env.group_size

    def _spawn(self, replica: int):
        options = {} if self.launcher is None else self.launcher.env_options(self.index, replica)
        return EnvActor.options(name=None, max_concurrency=max(4, self.env.concurrency * 2), **options).remote(
            self.config, self.index, replica, self.servers, self.reward_servers, self.teacher_servers
        )

    def launch(self, groups: int) -> int:
        """Start up to `groups` groups on replicas with room (fewest in flight first); returns how many started.
        Groups to sample again (deterministic runs) start first, at the head of the order, outside that count."""
        if self.to_resample:
            again = dict(self._start_group(replica, ticket) for replica, ticket in self.to_resample)
            self.inflight = {**again, **self.inflight}
            self.to_resample = []
        started = 0
        per_replica = [0] * len(self.actors)
        for replica, _, _ in self.inflight.values():
            per_replica[replica] += 1
        while started < groups:
            replica = min(range(len(self.actors)), key=lambda r: per_replica[r])
            if per_replica[replica] >= self.env.concurrency:
                break
            ref, entry = self._start_group(replica, self.iterator.next())
            self.inflight[ref] = entry
            per_replica[replica] += 1
            started += 1
        return started

    def _start_group(self, replica: int, ticket: ProblemTicket) -> tuple[ray.ObjectRef, tuple[int, ProblemTicket, Any]]:
        """Start `ticket`'s group on `replica` (seeded in deterministic runs); its `inflight` entry."""
        seed = self.iterator.sample_seed(ticket) if self.deterministic else None
        actor = self.actors[replica]
        ref = actor.run_group.remote(ticket.index, seed)
        self._launched_at[ref] = time.perf_counter()
        return ref, (replica, ticket, actor)

    def wait_refs(self) -> list[ray.ObjectRef]:
        """What the driver waits on: every in-flight group, or (deterministic) only the oldest one."""
        if self.deterministic:
            return [next(iter(self.inflight))] if self.inflight else []
        return list(self.inflight)

    def collect(self) -> list[tuple[ProblemTicket, dict]]:
        """Finished groups with their tickets. Deterministic: at most one, the oldest handed out, once it is done.

        A group whose actor died is not returned: its ticket is requeued (handed out again first) and the actor
        restarted.
        """
        if not self.inflight or self.to_resample:  # deterministic: the head of the order is to be sampled again
            return []
        refs = self.wait_refs()
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        out = []
        for ref in refs if self.deterministic else done:
            if ref not in done:
                break
            replica, ticket, actor = self.inflight.pop(ref)
            launched = self._launched_at.pop(ref, None)
            try:
                result = ray.get(ref)
            except RayActorError:
                self._hand_out_again(replica, ticket)
                self._new_failures += 1  # its node may be gone, and a server with it
                if self.actors[replica] is actor:
                    self.restart(replica)
                continue
            except (RayTaskError, UnserializableException) as e:  # the episode raised: most often its server is
                # gone; hand the problem out again
                self._failed(replica, ticket, e)
                continue
            self._failures_in_a_row = 0
            group = self._took(GroupResult.from_dict(result), launched)
            out.append((ticket, group))
        return out

    MAX_FAILURES_IN_A_ROW = 200
    """More groups failing in a row than this, with none succeeding in between, is a bug, not an outage."""

    def _hand_out_again(self, replica: int, ticket: ProblemTicket) -> None:
        if self.deterministic:
            self.to_resample.append((replica, ticket))  # same seed, same place in the order
        else:
            self.iterator.requeue(ticket)  # first in line

    def _failed(self, replica: int, ticket: ProblemTicket, error: Exception) -> None:
        self._hand_out_again(replica, ticket)
        self.failed_groups += 1
        self._new_failures += 1
        self._failures_in_a_row += 1
        cause = getattr(error, "cause", None) or error
        if self._failures_in_a_row == 1 or self._failures_in_a_row % 50 == 0:
            logger.warning(
                "%s: a group failed (%s: %s); its problem is handed out again",
                self.name,
                type(cause).__name__,
                str(cause).splitlines()[0][:200] if str(cause) else "",
            )
        if self._failures_in_a_row > self.MAX_FAILURES_IN_A_ROW:
            raise RuntimeError(
                f"{self.name}: {self._failures_in_a_row} groups failed in a row; the last one with: {cause!r}"
            ) from error

    def set_servers(self, servers: list[str]) -> None:
        """Send requests to `servers` from now on (this pool's actors and those it starts later)."""
        self.servers = list(servers)
        for a in self.actors:
            a.set_servers.remote(self.servers)

    def check_actor(self, replica: int, timeout_s: float = 30.0) -> None:
        """Replace env actor `replica` if it is dead."""
        try:
            ray.get(self.actors[replica].num_problems.remote(), timeout=timeout_s)
        except RayActorError:
            self.restart(replica)

    def restart(self, replica: int) -> None:
        """Replace a dead env actor and wait until it answers (`start_replacement`: `PlacementError` when no node
        can take it within `placement.wait_timeout_s`; `RestartLimitExceeded` once this environment's actors used
        up `orchestrator.max_restarts_per_role`)."""
        what = f"env actor {self.env.name}/{replica}"
        self.budget.spend(what)
        logger.error("%s died; replacing it", what)
        self.restarts += 1
        t = time.time()
        kill_quietly(self.actors[replica])
        self.actors[replica], _ = start_replacement(
            what,
            "envs",
            lambda: self._spawn(replica),
            lambda actor: actor.num_problems.remote(),
            self.config.placement.envs,
            self.config.placement.wait_timeout_s,
        )
        logger.info("%s replaced (%.1fs)", what, time.time() - t)

    def drop_in_flight(self) -> int:
        """Cancel the groups in flight and forget them (the run rolled back: the restored problem order hands their
        problems out again); returns how many were dropped."""
        for ref in self.inflight:
            try:
                ray.cancel(ref)  # an async actor task: its episode is cancelled where it awaits
            except Exception:
                pass
        dropped = len(self.inflight) + len(self.to_resample)
        self.inflight.clear()
        self._launched_at.clear()
        self.to_resample = []
        return dropped
