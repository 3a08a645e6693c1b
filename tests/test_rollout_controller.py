"""The rollout pipeline without Ray: `RolloutController` over the in-process `LocalWorkerPool` (the backend a
driver without Ray uses; runs on Ray use the same controller over env actors). A scripted environment returns
prepared groups, valid and malformed, without sampling, over an address nothing listens on.

Checked: malformed groups are refused with the replay buffer's reason codes (`replays/{env}/rejected/{reason}`, the
codes the API's gated path counts too) and are not failures; the staleness gate bounds what
is in flight and buffered; batches hold only valid rollouts; a failed group's problem is handed out again; the
controller's state round-trips through a checkpoint."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import numpy as np
import pytest
from test_validation_paths import ENV, GROUP_SIZE, VOCAB, ScriptedWorkflow, make_group

from marin_rl.envs.base import SamplingParams
from marin_rl.envs.iteration import ProblemIterator
from marin_rl.replay.batcher import Batcher, BatcherConfig
from marin_rl.replay.buffer import ReplayBuffer, ReplayConfig
from marin_rl.rollouts.controller import RolloutController, WorkerPool
from marin_rl.rollouts.local_pool import LocalWorkerPool
from marin_rl.rollouts.staleness import RolloutsPerBatch
from marin_rl.rollouts.worker import GroupResult, RolloutWorker

KINDS = ["valid", "logprob_count", "valid", "token_out_of_vocab", "valid", "missing_metadata", "valid", "valid"]


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


class FlakyWorkflow(ScriptedWorkflow):
    """The scripted workflow whose first episode of problem `fail_once` raises."""

    def __init__(self, groups, fail_once: str):
        super().__init__(groups)
        self.fail_once = fail_once

    async def run_group(self, policy, problem, group_size, sampling):
        if problem.id == self.fail_once:
            self.fail_once = None
            raise ConnectionError("the server went away")
        return await super().run_group(policy, problem, group_size, sampling)


class AcrossProcesses(LocalWorkerPool):
    """The local pool with each result sent as the Ray env actors send theirs: `GroupResult.to_dict()`, read back
    with `GroupResult.from_dict` (the group stays a dict for the replay buffer to validate)."""

    async def _run(self, problem, seed):
        sent = (await super()._run(problem, seed)).to_dict()
        assert isinstance(sent["group"], dict)
        return GroupResult.from_dict(sent)


def controller(loop, workflow, max_staleness=1, deterministic=False, rows=4, pool_class=LocalWorkerPool):
    pool = pool_class(
        workflow,
        RolloutWorker(["127.0.0.1:1"], timeout_s=5.0),
        loop,
        group_size=GROUP_SIZE,
        sampling=SamplingParams(max_tokens=4),
        tokens_per_batch=rows * 16,
        deterministic=deterministic,
    )
    buffers = {ENV: ReplayBuffer(ENV, ReplayConfig(min_group_size=GROUP_SIZE, max_age=8), vocab_size=VOCAB)}
    batcher = Batcher(BatcherConfig(total_token_budget=rows * 16, max_seq_len=16, block_timeout_s=None), buffers)
    return RolloutController({ENV: pool}, buffers, batcher, max_staleness, deterministic=deterministic), pool


def drive(rollouts: RolloutController, steps: int, timeout_s: float = 30.0):
    """The driver's loop with an instant learner: launch, admit, batch; every trained batch is version + 1."""
    version, batches, checks = 0, [], []
    deadline = time.time() + timeout_s
    while len(batches) < steps:
        assert time.time() < deadline, f"{len(batches)} of {steps} batches in {timeout_s}s"
        rollouts.launch(served_version=version, batches_formed=version)
        pool = rollouts.pools[ENV]
        capacity = rollouts.gates[ENV].capacity(version, version, pool.batch_size.value)
        checks.append(pool.in_flight_rollouts + len(rollouts.buffers[ENV]) <= capacity + GROUP_SIZE)
        pool.wait(0.05)
        rollouts.admit_finished(version)
        formed = rollouts.try_make_batch(version)
        if formed is not None:
            batches.append(formed)
            version += 1
    return batches, checks


@pytest.mark.parametrize("pool_class", [LocalWorkerPool, AcrossProcesses])
def test_malformed_groups_are_refused_with_the_replay_reasons_and_batches_hold_only_valid_rollouts(loop, pool_class):
    rng = np.random.default_rng(0)
    groups = {f"p{i}": make_group(kind, f"p{i}", rng) for i, kind in enumerate(KINDS)}
    valid_uids = {
        r.rollout_uid for g, k in zip(groups.values(), KINDS, strict=True) if k == "valid" for r in g.rollouts
    }
    rollouts, pool = controller(loop, ScriptedWorkflow(groups), pool_class=pool_class)
    profile = Counter()
    rollouts.count = profile.update
    batches, checks = drive(rollouts, steps=6)
    assert all(checks), "in flight + buffered stayed within the gate's capacity (plus one starved group)"
    trained = {item.rollout.rollout_uid for b in batches for item, _ in b.placed}
    assert trained and trained <= valid_uids
    metrics = rollouts.step_metrics(len(batches))
    for reason in ("logprob_count", "token_out_of_vocab", "missing_metadata"):
        assert metrics[f"replays/{ENV}/rejected/{reason}"] >= 1, metrics
    assert pool.failed_groups == 0  # a refused group is not a failed one: its problem is done
    assert profile["groups"] >= 6 and profile["group_s"] > 0 and profile["requests"] == 0, profile


def test_a_group_result_round_trips_as_plain_data():
    group = make_group("valid", "p0", np.random.default_rng(2))
    result = GroupResult(group, retried_requests=2, profile={"group_s": 0.5, "requests": 3.0})
    sent = result.to_dict()
    assert sent["group"] == group.to_dict() and sent["retried_requests"] == 2
    back = GroupResult.from_dict(sent)
    assert back.group == group.to_dict() and back.profile == result.profile and back.retried_requests == 2
    assert back.rollout_tokens == result.rollout_tokens == [r.num_tokens for r in group.rollouts]
    assert GroupResult.from_dict({"group": {"rollouts": [{}]}}).rollout_tokens == [], "malformed: the buffer says why"


def test_a_failed_group_is_handed_out_again_and_the_state_round_trips(loop):
    rng = np.random.default_rng(1)
    groups = {f"p{i}": make_group("valid", f"p{i}", rng) for i in range(4)}
    rollouts, pool = controller(loop, FlakyWorkflow(groups, fail_once="p2"), deterministic=True)
    batches, _ = drive(rollouts, steps=3)
    assert pool.failed_groups == 1 and len(batches) == 3
    problems = [item.rollout.problem_id for b in batches for item, _ in b.placed]
    assert "p2" in problems
    state = rollouts.state_dict()
    again, _ = controller(loop, ScriptedWorkflow(groups), deterministic=True)
    again.load_state_dict(state)
    assert again.state_dict() == state
    assert rollouts.drop_in_flight() >= 0 and not rollouts.busy


class HeldPool(WorkerPool):
    """Groups start and stay in flight until the test finishes them (`finish`); nothing is ever collected."""

    def __init__(self, name: str):
        super().__init__()
        self.name, self.group_size = name, 2
        self.iterator = ProblemIterator(10, seed=0)
        self.batch_size = RolloutsPerBatch(tokens_per_batch=32, initial_rollout_tokens=16)

    def launch(self, groups: int) -> int:
        for _ in range(groups):
            self.inflight[self.iterator.next()] = None
        return groups

    def finish(self) -> None:
        for ticket in list(self.inflight):
            self.iterator.done(ticket)
        self.inflight.clear()

    def collect(self):
        return []

    def drop_in_flight(self) -> int:
        return 0


@pytest.mark.parametrize("deterministic", [True, False])
def test_environments_that_wait_together_start_their_starvation_groups_together(deterministic):
    """Two environments the batcher waits for, no room under the gate (a batch in training): each may start one
    group while none of its own is in flight. Deterministic runs start them only while nothing at all is in flight
    (the batcher's verdict is current), so one cannot start a group each time the other's is still running."""
    pools = {n: HeldPool(n) for n in ("a", "b")}
    buffers = {n: ReplayBuffer(n, ReplayConfig()) for n in pools}
    batcher = Batcher(BatcherConfig(total_token_budget=64, max_seq_len=16), buffers)
    rollouts = RolloutController(pools, buffers, batcher, max_staleness=0, deterministic=deterministic)
    rollouts.waiting_for = {"a": 16, "b": 16}
    assert rollouts.launch(served_version=0, batches_formed=1) == 2, "both start one group together"
    pools["a"].finish()  # a's group is in; b's still runs
    assert rollouts.launch(served_version=0, batches_formed=1) == (0 if deterministic else 1)
    pools["b"].finish()
    rollouts.waiting_for = {"a": 8, "b": 8}  # the batcher's verdict once nothing is in flight
    assert rollouts.launch(served_version=0, batches_formed=1) == (2 if deterministic else 1)
