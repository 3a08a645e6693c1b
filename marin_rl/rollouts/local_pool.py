"""`LocalWorkerPool`: one environment's groups run in this process, on an event loop, by a `RolloutWorker`.

It is the in-process worker backend of `RolloutController` (the Ray backend is the orchestrator's `EnvPool`): the
same problem order (`ProblemIterator`), the same seeded sampling in deterministic runs, the same hand-out-again rule
for a failed group, so a driver without Ray gates, validates, scores and batches exactly like a run on Ray.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Iterable

from marin_rl.envs.base import Environment, Problem, SamplingParams
from marin_rl.envs.difficulty import PassRateConfig, problem_order
from marin_rl.envs.iteration import ProblemStream, ProblemTicket
from marin_rl.envs.rewards import OverlongPenalty
from marin_rl.inference.teacher import TeacherScorer
from marin_rl.rollouts.controller import WorkerPool
from marin_rl.rollouts.staleness import RolloutsPerBatch
from marin_rl.rollouts.worker import GroupOptions, GroupResult, RolloutWorker
from marin_rl.types import RolloutGroup

logger = logging.getLogger(__name__)


class LocalWorkerPool(WorkerPool):
    """Groups of `env`'s training problems, at most `concurrency` at once, run by `worker` on `loop` (an event loop
    running in another thread). `tokens_per_batch`: this environment's share of a batch, for the rollouts-per-batch
    estimate. `deterministic`: each group is sampled with a seed derived from its ticket and groups are collected in
    hand-out order; a failed group is sampled again, with the same seed, in its place. `overlong`: the environment's
    soft overlong penalty (`marin_rl.envs.rewards.add_overlong_penalty`). `pass_rate`: draw problems by their recent
    pass rate (`marin_rl.envs.difficulty`) instead of the seeded shuffle. `teacher` (on-policy distillation): scores
    every group before it is handed over, as the Ray backend's env actors do (`marin_rl.inference.teacher`).
    `problems`: draw problems from this iterable (a `ProblemStream`, not checkpointed) instead of the environment's
    training problems in the run's order; when it runs out, no group starts any more (`exhausted`)."""

    def __init__(
        self,
        env: Environment,
        worker: RolloutWorker,
        loop: asyncio.AbstractEventLoop,
        *,
        group_size: int,
        sampling: SamplingParams,
        tokens_per_batch: float,
        concurrency: int = 64,
        seed: int = 0,
        deterministic: bool = False,
        greedy_baseline: bool = False,
        overlong: OverlongPenalty | None = None,
        pass_rate: PassRateConfig | None = None,
        teacher: TeacherScorer | None = None,
        problems: Iterable[Problem] | None = None,
    ):
        self.env = env
        self.options = GroupOptions(group_size, sampling, greedy_baseline, overlong, teacher)
        self.worker = worker
        self.loop = loop
        self.group_size = group_size
        self.concurrency = concurrency
        self.deterministic = deterministic
        if problems is not None:
            self.iterator = ProblemStream(problems)
            self._problem = self.iterator.problem
        else:
            train = env.train_problems()
            if not train:
                raise ValueError(f"environment {env.name} has no training problems")
            self.iterator = problem_order(len(train), seed, env.name, pass_rate)
            self._problem = lambda ticket: train[ticket.index]
        self.batch_size = RolloutsPerBatch(tokens_per_batch, sampling.max_tokens + 16)
        super().__init__()
        self._launched_at: dict[concurrent.futures.Future, float] = {}
        self.inflight: dict[concurrent.futures.Future, ProblemTicket] = {}
        """Groups running, in hand-out order."""
        self.to_resample: list[ProblemTicket] = []
        self.last_error: BaseException | None = None
        """The error of the latest group that failed (its problem was handed out again)."""

    @property
    def name(self) -> str:
        """The environment's name."""
        return self.env.name

    def launch(self, groups: int) -> int:
        """Start up to `groups` groups (at most `concurrency` in flight); returns how many started. Groups to sample
        again (deterministic runs) start first, at the head of the order, outside that count."""
        if self.to_resample:
            again = dict(zip(self._start(self.to_resample), self.to_resample, strict=True))
            self.inflight = {**again, **self.inflight}
            self.to_resample = []
        tickets = []
        while len(tickets) < groups and len(self.inflight) + len(tickets) < self.concurrency:
            try:
                tickets.append(self.iterator.next())
            except StopIteration:  # a `problems` iterable ran out
                break
        self.inflight.update(zip(self._start(tickets), tickets, strict=True))
        return len(tickets)

    def _start(self, tickets: list[ProblemTicket]) -> list[concurrent.futures.Future]:
        """Start the groups of `tickets` on the loop (one wake-up of it for all); their futures, in order."""
        if not tickets:
            return []
        jobs = []
        for ticket in tickets:
            seed = self.iterator.sample_seed(ticket) if self.deterministic else None
            jobs.append((self._problem(ticket), seed, concurrent.futures.Future()))
        self.loop.call_soon_threadsafe(self._schedule, jobs)
        now = time.perf_counter()
        for _, _, future in jobs:
            self._launched_at[future] = now
        return [future for _, _, future in jobs]

    def _schedule(self, jobs: list) -> None:  # on the loop
        for problem, seed, future in jobs:
            if future.cancelled():  # dropped before it started
                continue
            task = self.loop.create_task(self._run(problem, seed))
            task.add_done_callback(lambda t, f=future: _settle(f, t))
            future.add_done_callback(
                lambda f, t=task: self.loop.call_soon_threadsafe(t.cancel) if f.cancelled() else None
            )

    async def _run(self, problem, seed: int | None) -> GroupResult:
        return await self.worker.sample_group(self.env, problem, self.options, seed)

    def wait(self, timeout_s: float) -> None:
        """Block until a group in flight finishes (deterministic: the oldest), at most `timeout_s`."""
        if not self.inflight:
            return
        futures = [next(iter(self.inflight))] if self.deterministic else list(self.inflight)
        concurrent.futures.wait(futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def collect(self) -> list[tuple[ProblemTicket, RolloutGroup]]:
        """Finished groups with their tickets (deterministic: only in hand-out order). A group whose episode raised
        is not returned: its problem is handed out again, first."""
        if self.to_resample:  # deterministic: the head of the order is to be sampled again
            return []
        out = []
        for future in list(self.inflight):
            if not future.done():
                if self.deterministic:
                    break
                continue
            ticket = self.inflight.pop(future)
            launched = self._launched_at.pop(future)
            try:
                result = future.result()
            except Exception as e:  # noqa: BLE001 - the episode raised: hand its problem out again
                self._failed(ticket, e)
                continue
            group = self._took(result, launched)
            out.append((ticket, group))
        return out

    def _failed(self, ticket: ProblemTicket, error: BaseException) -> None:
        if self.deterministic:
            self.to_resample.append(ticket)  # same seed, same place in the order
        else:
            self.iterator.requeue(ticket)  # first in line
        self.failed_groups += 1
        self._new_failures += 1
        self.last_error = error
        logger.warning(
            "%s: a group failed (%s: %s); its problem is handed out again", self.name, type(error).__name__, error
        )

    def drop_in_flight(self) -> int:
        """Cancel the groups in flight and forget them; returns how many were dropped."""
        for future in self.inflight:
            future.cancel()
        dropped = len(self.inflight) + len(self.to_resample)
        self.inflight.clear()
        self._launched_at.clear()
        self.to_resample = []
        return dropped


def _settle(future: concurrent.futures.Future, task: asyncio.Task) -> None:
    """Hand a finished group task's result (or error) to the driver's future, unless the driver dropped it."""
    if future.cancelled():
        return
    try:
        if task.cancelled():
            future.cancel()
        elif task.exception() is not None:
            future.set_exception(task.exception())
        else:
            future.set_result(task.result())
    except concurrent.futures.InvalidStateError:  # cancelled by the driver meanwhile
        pass
