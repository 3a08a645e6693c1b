"""`GatedRollouts`: an `InferenceEngine`'s gated work (`submit`, `wait`, `prepare_batch`) under the staleness gate.

Groups start only as the staleness gate (`marin_rl.api.staleness`) allows, with v the version the servers serve
(`version`), b the batches `prepare_batch` has returned and B = `batch_size × group_size` rollouts per batch.
Generation continues in the background between calls (asynchronous preparation), at most η = `max_staleness`
versions ahead. `prepare_batch` also discards, and counts, a finished group with a token older than v − η, so no
group it returns lags more than η versions behind the served policy: with weights pushed after every train step
(`TrainEngine.update_weights`), no trained token lags more than η.

Every group is validated when it finishes (`marin_rl.replay.validation.check_group`, the replay buffers' check,
against the workflow's name and the vocabulary size when it is known): an invalid one (a token id outside the
vocabulary, a logprob count that does not match the sampled tokens, a sampled turn without a policy version, an
inconsistent group...) is never handed out by `wait` or `prepare_batch`; it is logged and counted under
`rejected/{reason}`, with the reason code a replay buffer would give it, and frees its room in the gate.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from marin_rl.api.engine_config import EngineConfig
from marin_rl.api.event_loop import BackgroundLoop
from marin_rl.api.rollouts import RolloutWorker
from marin_rl.api.staleness import GateInputs, StalenessGate
from marin_rl.envs.base import Environment, Problem
from marin_rl.replay.validation import GroupRejected, check_group
from marin_rl.types import RolloutGroup

logger = logging.getLogger(__name__)


@dataclass
class GroupResult:
    """A finished gated group (what `wait` and `prepare_batch` return)."""

    group: RolloutGroup
    """The scored rollouts."""
    problem: Problem
    """The problem it was sampled for."""
    started_version: int
    """Version the servers served when the group started."""
    oldest_version: int
    """Oldest policy version among its sampled tokens."""


class GatedRollouts:
    """The gated groups of one engine (module docstring): the queue of `submit`, the dataloader of `prepare_batch`,
    the rollouts in flight, the finished groups, the served version the gate reads, and the counters.

    Groups of `config.group_size` episodes at `config.sampling` run through `worker` on `loop` (the engine's event
    loop); at most `config.max_concurrent_groups` at once on top of the gate's own bound; a batch is
    `config.batch_size` groups; token ids are validated against `vocab_size` (None: only for being non-negative
    integers). Thread-safe, like the engine."""

    def __init__(self, worker: RolloutWorker, loop: BackgroundLoop, config: EngineConfig, vocab_size: int | None):
        self.worker = worker
        self.loop = loop
        self.group_size = config.group_size
        self.sampling = config.sampling
        self.batch_size = config.batch_size
        self.max_staleness = config.max_staleness
        self.max_concurrent_groups = config.max_concurrent_groups
        self.vocab_size = vocab_size
        self._gate = StalenessGate(self.max_staleness, self.group_size)
        self._cond = threading.Condition()
        self._version = -1
        self._base: int | None = None  # version when the first gated batch was asked for
        self._batches = 0
        self._paused = False
        self._closed = False
        self._pending: collections.deque[tuple[Problem, Environment]] = collections.deque()
        self._source: tuple[Iterator[Problem], Environment] | None = None
        self._source_key: int | None = None
        self._in_flight = 0  # rollouts of gated groups running
        self._done: collections.deque[GroupResult] = collections.deque()
        self._errors: list[BaseException] = []
        self._wanting = False  # a prepare_batch call is waiting (the gate's starvation rule may then start one group)
        self._held = 0  # rollouts of the batch a prepare_batch call is filling (buffered, for the gate)
        self.counters = collections.Counter()
        """Gated groups: started, finished (came back from the workflow), `rejected/{reason}` (finished but invalid:
        validation's reason code), accepted, rejected (by `should_accept`), discarded_stale, failed."""

    # ---- what the gate reads ------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The policy version the servers serve (-1 before any update)."""
        return self._version

    def set_version(self, version: int) -> None:
        """The servers serve `version`: groups may start again as the gate allows. Non-blocking."""
        with self._cond:
            self._version = int(version)
        self._pump()

    @property
    def paused(self) -> bool:
        """Whether starting groups is paused (`set_paused`)."""
        return self._paused

    def set_paused(self, paused: bool) -> None:
        """Start no new group while `paused`; unpaused, groups start again as the gate allows."""
        with self._cond:
            self._paused = paused
        if not paused:
            self._pump()

    def close(self) -> bool:
        """Start no group any more; returns False when already closed."""
        with self._cond:
            if self._closed:
                return False
            self._closed = True
            return True

    # ---- the calls ----------------------------------------------------------------------------------
    def submit(self, problem: Problem, workflow: Environment) -> None:
        """Queue one group of `problem` through `workflow`; it starts when the staleness gate allows. Non-blocking;
        collect it with `wait`."""
        with self._cond:
            self._check_can_start()
            self._pending.append((problem, workflow))
        self._pump()

    def wait(self, count: int, timeout: float | None = None) -> list[GroupResult]:
        """Block until `count` groups have finished and return them (first finished first). Groups that failed
        validation are not returned (they are counted under `counters['rejected/{reason}']`). Raises TimeoutError
        after `timeout` seconds (the finished ones stay for the next call) and re-raises the error of a failed
        episode."""
        deadline = None if timeout is None else time.time() + timeout
        with self._cond:
            while True:
                self._raise_errors()
                if len(self._done) >= count:
                    return [self._done.popleft() for _ in range(count)]
                left = None if deadline is None else deadline - time.time()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"{len(self._done)} of {count} groups finished within {timeout}s "
                        f"({self._in_flight} rollouts in flight)"
                    )
                self._cond.wait(0.5 if left is None else min(left, 0.5))

    def prepare_batch(
        self,
        dataloader: Iterable[Problem],
        workflow: Environment,
        should_accept: Callable[[RolloutGroup], bool] | None = None,
        timeout: float | None = None,
    ) -> list[RolloutGroup]:
        """Block until `batch_size` groups have passed `should_accept` and return them (first finished first),
        while groups of problems drawn from `dataloader` keep starting, in the background and between calls, as
        the staleness gate allows. Passing the same iterable again continues it; another one replaces it. Each call
        counts as one batch formed (b in the gate). A finished group with a token older than
        `version − max_staleness` is discarded and counted (`counters['discarded_stale']`); one that failed
        validation never gets here (`counters['rejected/{reason}']`, module docstring). Raises TimeoutError after
        `timeout` seconds, StopIteration when the dataloader is exhausted before the batch is full, and the error
        of a failed episode."""
        accept = should_accept or (lambda group: True)
        with self._cond:
            self._check_can_start()
            if self._source_key != id(dataloader):
                self._source = (iter(dataloader), workflow)
                self._source_key = id(dataloader)
            else:
                self._source = (self._source[0], workflow)
            if self._base is None:
                self._base = max(self._version, 0)
            self._wanting = True
        self._pump()
        deadline = None if timeout is None else time.time() + timeout
        out: list[GroupResult] = []
        try:
            while len(out) < self.batch_size:
                with self._cond:
                    self._raise_errors()
                    while self._done and len(out) < self.batch_size:
                        result = self._done.popleft()
                        if result.oldest_version < self._version - self.max_staleness:
                            self.counters["discarded_stale"] += 1
                        elif accept(result.group):
                            self.counters["accepted"] += 1
                            out.append(result)
                            self._held += len(result.group.rollouts)
                        else:
                            self.counters["rejected"] += 1
                    if len(out) >= self.batch_size:
                        break
                    if self._source is None and not self._in_flight and not self._pending:
                        raise StopIteration(
                            f"the dataloader ran out with {len(out)} of {self.batch_size} groups of the batch"
                        )
                    left = None if deadline is None else deadline - time.time()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"{len(out)} of {self.batch_size} groups within {timeout}s")
                    self._cond.wait(0.5 if left is None else min(left, 0.5))
                self._pump()  # rejected or discarded groups freed room
        finally:
            with self._cond:
                self._wanting = False
                self._held = 0
                if len(out) == self.batch_size:
                    self._batches += 1
                else:  # not handed out: back to the front of the queue
                    self._done.extendleft(reversed(out))
        self._pump()
        return [r.group for r in out]

    def stats(self) -> dict[str, Any]:
        """Version, batches formed, rollouts in flight, finished groups and the counters (`groups/{counter}`)."""
        with self._cond:
            return {
                "version": self._version,
                "batches": self._batches,
                "in_flight_rollouts": self._in_flight,
                "finished_groups": len(self._done),
                **{f"groups/{k}": v for k, v in self.counters.items()},
            }

    # ---- starting and finishing groups --------------------------------------------------------------
    def _gate_inputs(self) -> GateInputs:
        base = self._base if self._base is not None else max(self._version, 0)
        buffered = self._held + sum(len(r.group.rollouts) for r in self._done)
        per_batch = self.batch_size * self.group_size
        return GateInputs(
            served_version=max(self._version, base),
            batches_formed=base + self._batches,
            in_flight=self._in_flight,
            buffered=buffered,
            rollouts_per_batch=float(per_batch),
            starved=self._wanting and buffered < per_batch,  # what finished cannot fill the batch being asked for
        )

    def _pump(self) -> None:
        """Start the groups the gate allows now (from the queue of `submit`, then the dataloader)."""
        with self._cond:
            if self._paused or self._closed:
                return
            allowed = self._gate.groups_allowed(self._gate_inputs())
            limit = self.max_concurrent_groups - self._in_flight // self.group_size
            for _ in range(max(0, min(allowed, limit))):
                if self._pending:
                    problem, workflow = self._pending.popleft()
                elif self._source is not None:
                    try:
                        problem = next(self._source[0])
                    except StopIteration:
                        self._source = None
                        break
                    workflow = self._source[1]
                else:
                    break
                self._in_flight += self.group_size
                self.counters["started"] += 1
                self.loop.start(self._run_group(problem, workflow, self._version))

    async def _run_group(self, problem: Problem, workflow: Environment, version: int) -> None:
        rejected: GroupRejected | None = None
        try:
            group = await self.worker.run_group(workflow, problem, self.group_size, self.sampling)
            try:
                check_group(group, workflow.name, self.vocab_size)  # the replay buffers' validation
            except GroupRejected as e:
                rejected = e
            else:
                oldest = min((r.oldest_version for r in group.rollouts), default=version)
        except BaseException as e:  # noqa: BLE001 - handed to the caller of wait/prepare_batch
            with self._cond:
                self._in_flight -= self.group_size
                self.counters["failed"] += 1
                self._errors.append(e)
                self._cond.notify_all()
            return
        if rejected is not None:
            logger.warning(
                "InferenceEngine: rejected a group of %s, problem %s (%s): %s",
                workflow.name,
                problem.id,
                rejected.reason,
                rejected.detail,
            )
        with self._cond:
            self._in_flight -= self.group_size  # a rejected group frees its room in the gate
            self.counters["finished"] += 1
            if rejected is not None:
                self.counters[f"rejected/{rejected.reason}"] += 1
            else:
                self._done.append(GroupResult(group, problem, version, oldest))
            self._cond.notify_all()
        self._pump()

    def _raise_errors(self) -> None:
        if self._errors:
            error = self._errors.pop(0)
            raise RuntimeError(f"a group failed: {error!r}") from error

    def _check_can_start(self) -> None:
        if self._closed:
            raise RuntimeError("the InferenceEngine is closed")
        if self._version < 0:
            raise RuntimeError(
                "gated work needs the servers to serve a policy version first: call "
                "TrainEngine.update_weights(inference) (or apply_update / set_version) before submit or prepare_batch "
                "(tokens of the initial weights, version -1, carry no policy version and would be rejected)"
            )
