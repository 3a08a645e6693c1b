"""`RolloutController`: the rollout pipeline between the environments' workers and the learner.

For every environment it owns the staleness gate (`marin_rl.rollouts.staleness`), the groups in flight (a `WorkerPool`:
Ray env actors in a run, `marin_rl.orchestrator.ray_backend.env_pool.EnvPool`), admission into the environment's
replay buffer (validate → score → persist → enqueue, `ReplayBuffer.admit`) and the batcher over the buffers. A
driver calls, in its loop:

    controller.launch(served_version, batches_formed)   # start the groups the gate allows
    controller.admit_finished(learner_version)          # finished groups into the buffers
    controller.try_make_batch(learner_version)          # a packed batch, or None (and what is awaited)

and reads `step_metrics`, `state_dict`/`load_state_dict` (checkpoints), `drop_in_flight` (a rollback). The worker
pool decides where groups run; everything that decides what is trained on (the gate, validation, advantages, the
staleness bound `replay.max_age`, too-long rollouts, the batch rule) lives here and in the replay buffers, once.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from marin_rl.config import RunConfig
from marin_rl.envs.iteration import ProblemIterator, ProblemTicket
from marin_rl.replay.batcher import Batcher, BatchWait, FormedBatch
from marin_rl.replay.buffer import ReplayBuffer
from marin_rl.rollouts.staleness import GateInputs, RolloutsPerBatch, StalenessGate
from marin_rl.rollouts.worker import CLIENT_COUNTERS, GroupResult
from marin_rl.types import RolloutGroup


class WorkerPool:
    """Where one environment's groups run (Ray env actors, or this process): the interface the controller drives,
    and what every pool keeps alike: groups in flight (`inflight`) and to sample again (`to_resample`), the failure
    and profile counters, and the checkpoint state (problem order, batch-size estimate, restarts). Subclasses set
    `name`, `group_size`, `iterator`, `batch_size`, fill `inflight` / `to_resample`, and implement `launch`,
    `collect` and `drop_in_flight`."""

    name: str
    """The environment's name."""
    group_size: int
    """Rollouts per group."""
    iterator: ProblemIterator
    """The environment's problem order (the driver's; tickets are settled by the controller)."""
    batch_size: RolloutsPerBatch
    """Estimate of the rollouts a batch takes from this environment (B in the gate)."""

    def __init__(self):
        self.inflight: dict = {}
        self.to_resample: list = []
        self.restarts = 0
        self.failed_groups = 0
        """Groups that raised (e.g. their server went away) and were handed out again."""
        self.retried_requests = 0
        """Requests sent again to another server because theirs could not be reached (the group went on)."""
        self._new_failures = 0
        self._profile_counts: dict[str, float] = defaultdict(float)

    @property
    def exhausted(self) -> bool:
        """Whether the problem order ran out (a finite `problems` iterable; never for an environment's own
        problems, which start another epoch)."""
        return self.iterator.exhausted

    @property
    def in_flight_rollouts(self) -> int:
        """Rollouts of the groups in flight (and of those waiting to be sampled again)."""
        return (len(self.inflight) + len(self.to_resample)) * self.group_size

    @property
    def busy(self) -> bool:
        """Whether a group is in flight or waiting to be sampled again."""
        return bool(self.inflight or self.to_resample)

    def take_failures(self) -> int:
        """Groups that failed (or whose worker died) since the last call."""
        n, self._new_failures = self._new_failures, 0
        return n

    def take_profile_counts(self) -> dict[str, float]:
        """Counted since the last call, for the loop profile: groups collected, their seconds in the worker and
        from launch to collect, and their clients' requests and request seconds."""
        out, self._profile_counts = dict(self._profile_counts), defaultdict(float)
        return out

    def launch(self, groups: int) -> int:
        """Start up to `groups` groups; returns how many started."""
        raise NotImplementedError

    def collect(self) -> list[tuple[ProblemTicket, RolloutGroup | dict]]:
        """Finished groups with their tickets (a group may be a `RolloutGroup.to_dict()`: `GroupResult.group`)."""
        raise NotImplementedError

    def _took(self, result: GroupResult, launched: float | None) -> RolloutGroup | dict:
        """Count a finished group's result (`launched`: when it was handed out, None when unknown) into the
        counters and the batch-size estimate; returns its group."""
        self.retried_requests += result.retried_requests
        if launched is not None:
            self._profile_counts["groups"] += 1
            self._profile_counts["turnaround_s"] += time.perf_counter() - launched  # launch to collect
            self._profile_counts["group_s"] += result.profile.get("group_s", 0.0)
        for key in CLIENT_COUNTERS[1:]:
            self._profile_counts[key] += result.profile.get(key, 0.0)
        self.batch_size.observe_rollout_tokens(result.rollout_tokens)
        return result.group

    def drop_in_flight(self) -> int:
        """Cancel and forget the groups in flight; returns how many."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint state: the problem order (in-flight problems become redo), the batch-size estimate, counters."""
        return {"iterator": self.iterator.state_dict(), **self.batch_size.state_dict(), "restarts": self.restarts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output (before anything is launched)."""
        self.iterator.load_state_dict(state["iterator"])
        self.batch_size.load_state_dict(state)
        self.restarts = int(state["restarts"])


@dataclass(frozen=True)
class Admitted:
    """What one `admit_finished` call took in."""

    sampled_tokens: int
    """Tokens the policy sampled in the groups collected (accepted or not)."""
    failures: int
    """Groups that failed in the workers since the last call (their problems are handed out again)."""


def _no_section(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class RolloutController:
    """The gate, the groups in flight, admission and batching of every environment of a run (module docstring).

    `section(name)` (a context manager factory) and `count(**counters)` receive the loop profile's timings and
    counters (e.g. `LoopProfile.section`, `LoopProfile.count`); both are optional. `deterministic`: a batch forms
    only while no group is in flight, so the batch sequence is a function of the config."""

    def __init__(
        self,
        pools: dict[str, WorkerPool],
        buffers: dict[str, ReplayBuffer],
        batcher: Batcher,
        max_staleness: int,
        deterministic: bool = False,
        section: Callable[[str], contextlib.AbstractContextManager] = _no_section,
        count: Callable[..., None] | None = None,
    ):
        if set(pools) != set(buffers):
            raise ValueError(f"worker pools {sorted(pools)} and replay buffers {sorted(buffers)} name other envs")
        self.pools = pools
        self.buffers = buffers
        self.batcher = batcher
        self.gates = {name: StalenessGate(max_staleness, pool.group_size) for name, pool in pools.items()}
        self.deterministic = deterministic
        self.section = section
        self.count = count or (lambda **_: None)
        self.waiting_for: dict[str, int] = {}
        """Environments the batcher waits for, with the tokens they lack (their gates may start a group anyway)."""

    # ---- the loop's three calls ---------------------------------------------------------------------------------
    def launch(self, served_version: int, batches_formed: int) -> int:
        """Start, in every environment, the groups its gate allows (v = `served_version`, b = `batches_formed`,
        the batch in training included); returns how many started. Deterministic runs apply the starvation rule
        only while no group is in flight anywhere: the batcher's `waiting_for` is then current (it is not asked while
        groups are in flight), so environments that wait together start their groups together, instead of one
        starting a group whenever the other's is in flight, for as long as timing lets them alternate."""
        started = 0
        verdict_current = not self.deterministic or not self.busy
        if self.batcher.schedule.varies:  # the next batch trains at step b + 1: B follows the share it will take
            shares = self.batcher.schedule.at(batches_formed + 1)
            for name, pool in self.pools.items():
                pool.batch_size.set_share(shares[name] * self.batcher.budget)
        for name, pool in self.pools.items():
            state = GateInputs(
                served_version=served_version,
                batches_formed=batches_formed,
                in_flight=pool.in_flight_rollouts,
                buffered=len(self.buffers[name]),
                rollouts_per_batch=pool.batch_size.value,
                starved=name in self.waiting_for and verdict_current,
            )
            started += pool.launch(self.gates[name].groups_allowed(state))
        return started

    def admit_finished(self, learner_version: int) -> Admitted:
        """Collect every finished group and admit it into its environment's buffer (a group sampled by a version
        newer than `learner_version` is rejected and its problem handed out again; every other problem is done)."""
        sampled = failures = 0
        for name, pool in self.pools.items():
            with self.section("collect"):
                groups = pool.collect()
            self.count(**pool.take_profile_counts())
            failures += pool.take_failures()
            with self.section("admit"):
                for ticket, group in groups:
                    admission = self.buffers[name].admit(group, max_version=learner_version)
                    sampled += admission.sampled_tokens
                    if admission.sampled_by_future_version:  # weights this learner never had (before a restore)
                        pool.iterator.requeue(ticket)
                    else:
                        pool.iterator.done(ticket, admission.rewards)
        return Admitted(sampled_tokens=sampled, failures=failures)

    def try_make_batch(self, learner_version: int) -> FormedBatch | None:
        """A batch for learner version `learner_version` when the buffers can fill one (`Batcher.try_make_batch`),
        else None; `waiting_for` says which environments it waits for. Deterministic runs form a batch only once
        no group is in flight."""
        if self.deterministic and any(p.busy for p in self.pools.values()):
            return None
        result = self.batcher.try_make_batch(learner_version)
        if isinstance(result, BatchWait):
            self.waiting_for = result.missing
            return None
        self.waiting_for = {}
        if result is not None:
            for name, usage in result.usage.items():
                self.pools[name].batch_size.observe_batch(usage.rollouts)
                self.pools[name].iterator.refresh()  # a pass-rate sampler applies the results reported so far
        return result

    # ---- per step, rollbacks and checkpoints --------------------------------------------------------------------
    def step_metrics(self, learner_version: int) -> dict[str, float]:
        """The buffers' `replays/...` metrics and the workers' counters (`envs/...`) for the step that made
        `learner_version`; starts the buffers' next metrics window and flushes their rollout files."""
        metrics: dict[str, float] = {}
        for buffer in self.buffers.values():
            metrics.update(buffer.metrics(learner_version))
            buffer.start_window()
            buffer.flush()
        for name, pool in self.pools.items():  # counted, never silent: actors replaced, groups handed out again
            metrics.update(pool.iterator.metrics(name))  # a pass-rate sampler's `problems/...` buckets
            metrics[f"envs/{name}/actor_restarts"] = float(pool.restarts)
            metrics[f"envs/{name}/failed_groups"] = float(pool.failed_groups)
            metrics[f"envs/{name}/retried_requests"] = float(pool.retried_requests)
        return metrics

    def totals(self) -> dict[str, int]:
        """Counters over every environment: `env_restarts`, `failed_groups`, `retried_requests`, and
        `accepted_groups` (along the run's surviving timeline: a rollback restores the checkpoint's count)."""
        pools = self.pools.values()
        return {
            "accepted_groups": sum(b.accepted_groups for b in self.buffers.values()),
            "env_restarts": sum(p.restarts for p in pools),
            "failed_groups": sum(p.failed_groups for p in pools),
            "retried_requests": sum(p.retried_requests for p in pools),
        }

    @property
    def busy(self) -> bool:
        """Whether any group is in flight."""
        return any(p.busy for p in self.pools.values())

    def drop_in_flight(self) -> int:
        """Cancel every group in flight (the run rolls back; the restored problem order hands their problems out
        again) and forget what the batcher waited for; returns how many groups were dropped."""
        self.waiting_for = {}
        return sum(pool.drop_in_flight() for pool in self.pools.values())

    def begin_segment(self, step: int) -> int:
        """Start a new run segment at learner step `step`, after a fresh start, a resume or a rollback has set the
        buffers' state: the groups accepted from now on belong to it, and each buffer's rollout timeline records
        which segment's state it continues (`ReplayBuffer.begin_segment`). Returns the new segment, one past every
        segment recorded or begun so far."""
        known = [s for b in self.buffers.values() for s in [*b.recorded_segments(), b.segment] if s is not None]
        segment = max(known, default=-1) + 1
        for buffer in self.buffers.values():
            buffer.begin_segment(segment, step)
        return segment

    def flush(self) -> None:
        """Write the rollouts the buffers queued for their files."""
        for buffer in self.buffers.values():
            buffer.flush()

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint state: each environment's problem order and batch-size estimate (`pools`) and replay buffer
        (`buffers`)."""
        return {
            "pools": {n: p.state_dict() for n, p in self.pools.items()},
            "buffers": {n: b.state_dict() for n, b in self.buffers.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` (before anything is launched). A run state of format 1 kept the too-long counts
        in a `batcher` entry; they move to the buffers."""
        if set(state["pools"]) != set(self.pools):
            raise ValueError(f"the checkpoint has envs {sorted(state['pools'])}, the config {sorted(self.pools)}")
        for n, pool in self.pools.items():
            pool.load_state_dict(state["pools"][n])
            buffer_state = dict(state["buffers"][n])
            if "batcher" in state:
                buffer_state["truncated_too_long"] = state["batcher"]["truncated_too_long"][n]
            self.buffers[n].load_state_dict(buffer_state)


def run_rollout_controller(
    config: RunConfig,
    pools: dict[str, WorkerPool],
    vocab_size: int,
    section: Callable[[str], contextlib.AbstractContextManager],
    count: Callable[..., None],
) -> RolloutController:
    """The rollout controller of a run of `config` over its environments' `pools`: a replay buffer per environment
    (persisting to `output_dir/rollouts/<env>`), the batcher over them at the environments' shares, the staleness
    bound; `section`/`count` receive its profile timings and counters (both backends build theirs with this)."""
    buffers = {
        e.name: ReplayBuffer(
            e.name,
            config.replay,
            vocab_size,
            rollout_dir=os.path.join(config.output_dir, "rollouts", e.name),
            max_tokens=config.batcher.max_seq_len,
            too_long=config.batcher.too_long,
        )
        for e in config.envs
    }
    return RolloutController(
        pools,
        buffers,
        Batcher(config.batcher, buffers, schedule=config.fraction_schedule()),
        config.orchestrator.max_staleness,
        deterministic=config.orchestrator.deterministic,
        section=section,
        count=count,
    )
