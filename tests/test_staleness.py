"""The staleness gate (`marin_rl.rollouts.staleness`): its arithmetic, its invariant, and the lag bounds the
module docstring states, checked on simulated asynchronous runs with random timings."""

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marin_rl.replay.batcher import Batcher, BatcherConfig, FormedBatch
from marin_rl.replay.buffer import ReplayBuffer, ReplayConfig
from marin_rl.rollouts.staleness import GateInputs, RolloutsPerBatch, StalenessGate
from marin_rl.types import InferenceMetadata, Rollout, RolloutGroup, Turn


def test_allowance_is_the_room_left_in_whole_groups():
    gate = StalenessGate(max_staleness=1, group_size=4)
    # v=3 served, b=3 formed: (3 + 1 + 1 - 3) = 2 batches of 8 rollouts = 16; 5 outstanding -> 11 left -> 2 groups
    assert gate.groups_allowed(GateInputs(3, 3, in_flight=4, buffered=1, rollouts_per_batch=8)) == 2
    assert gate.capacity(3, 3, 8) == 16
    # generation may not run ahead of what the learner has formed: b > v + η + 1 gives no room at all
    assert gate.capacity(0, 5, 8) == 0
    assert gate.groups_allowed(GateInputs(0, 5, in_flight=0, buffered=0, rollouts_per_batch=8)) == 0


def test_synchronous_gate_allows_one_batch_of_data_per_served_version():
    gate = StalenessGate(max_staleness=0, group_size=2)
    # v=0, nothing formed: one batch (6 rollouts) of room
    assert gate.groups_allowed(GateInputs(0, 0, 0, 0, rollouts_per_batch=6)) == 3
    # the batch formed and trains on weights the servers do not have yet: nothing new starts
    assert gate.groups_allowed(GateInputs(0, 1, 0, 0, rollouts_per_batch=6)) == 0
    # its weights arrive: the next batch's worth
    assert gate.groups_allowed(GateInputs(1, 1, 0, 0, rollouts_per_batch=6)) == 3


def test_starvation_lets_one_group_start_only_when_nothing_is_in_flight():
    gate = StalenessGate(max_staleness=0, group_size=8)
    full = GateInputs(0, 1, in_flight=0, buffered=0, rollouts_per_batch=8, starved=True)
    assert gate.groups_allowed(full) == 1
    assert gate.groups_allowed(GateInputs(0, 1, in_flight=8, buffered=0, rollouts_per_batch=8, starved=True)) == 0
    assert gate.groups_allowed(GateInputs(0, 1, in_flight=0, buffered=0, rollouts_per_batch=8, starved=False)) == 0


def test_asking_again_without_a_change_starts_nothing_more():
    gate = StalenessGate(max_staleness=2, group_size=3)
    state = GateInputs(5, 4, in_flight=0, buffered=7, rollouts_per_batch=10)
    n = gate.groups_allowed(state)
    assert n > 0
    after = GateInputs(5, 4, in_flight=3 * n, buffered=7, rollouts_per_batch=10)
    assert gate.groups_allowed(after) == 0


def test_rejects_bad_parameters():
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessGate(-1, 4)
    with pytest.raises(ValueError, match="group_size"):
        StalenessGate(1, 0)


def test_rollouts_per_batch_starts_from_the_token_share_and_follows_batches():
    est = RolloutsPerBatch(tokens_per_batch=1000, initial_rollout_tokens=100)
    assert est.value == 10
    est.observe_rollout_tokens([50] * 8)
    assert est.value == pytest.approx(1000 / 95)
    est.observe_batch(20)
    assert est.value == 20
    est.observe_batch(10)
    assert est.value == pytest.approx(18)
    restored = RolloutsPerBatch(1, 1)
    restored.load_state_dict(est.state_dict())
    assert restored.value == est.value


# ---- simulated asynchronous runs ------------------------------------------------------------------------------


def simulate(
    rng: np.random.Generator,
    max_staleness: int,
    group_size: int,
    groups_per_batch: int,
    steps: int,
    order: str,
    max_concurrency: int = 64,
):
    """An asynchronous run with random timings: groups take 1-6 ticks to generate, learner steps 1-4 ticks, a
    broadcast 0-2 ticks after its step. Batches take exactly `groups_per_batch` groups in `order`: 'started' (the
    order groups were started in: a finished group enters the buffer only after every group started before it, as
    in deterministic runs), 'arrival' (the order they finished in), 'newest' (the latest arrivals first).

    Returns (the lag of every trained group: learner version that trained it - version that sampled it, the
    largest outstanding/capacity excess seen after a gate decision, in rollouts).
    """
    gate = StalenessGate(max_staleness, group_size)
    B = group_size * groups_per_batch
    served, formed, steps_done = 0, 0, 0
    in_flight = []  # [finish tick, start order, sampled version]
    buffer = []  # (start order, sampled version, arrival order)
    training = None  # finish tick of the learner step
    pending_broadcast = []  # (tick, version)
    lags, worst_excess = [], 0
    started = arrivals = tick = 0
    while steps_done < steps:
        tick += 1
        finished = sorted((g for g in in_flight if g[0] <= tick), key=lambda g: g[1])
        if order == "started":  # only the finished groups that no unfinished earlier one precedes
            first_unfinished = min((g[1] for g in in_flight if g[0] > tick), default=started)
            finished = [g for g in finished if g[1] < first_unfinished]
        for f in finished:
            in_flight.remove(f)
            buffer.append((f[1], f[2], arrivals))
            arrivals += 1
        if training is not None and training <= tick:
            training = None
            steps_done += 1
            pending_broadcast.append((tick + int(rng.integers(0, 3)), steps_done))
        for b in [b for b in pending_broadcast if b[0] <= tick]:
            pending_broadcast.remove(b)
            served = max(served, b[1])
        if training is None and len(buffer) >= groups_per_batch:
            key = {"started": lambda g: g[0], "arrival": lambda g: g[2], "newest": lambda g: -g[2]}[order]
            take = sorted(buffer, key=key)[:groups_per_batch]
            for g in take:
                buffer.remove(g)
                lags.append(formed - g[1])  # batch `formed` is trained by learner version `formed`
            formed += 1
            training = tick + int(rng.integers(1, 5))
        state = GateInputs(served, formed, len(in_flight) * group_size, len(buffer) * group_size, B)
        allowed = min(gate.groups_allowed(state), max_concurrency - len(in_flight))
        for _ in range(allowed):
            in_flight.append([tick + int(rng.integers(1, 7)), started, served])
            started += 1
        outstanding = (len(in_flight) + len(buffer)) * group_size
        worst_excess = max(worst_excess, outstanding - gate.capacity(served, formed, B))
    return lags, worst_excess


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    eta=st.integers(0, 4),
    group_size=st.integers(1, 4),
    groups_per_batch=st.integers(1, 4),
)
def test_gate_invariant_and_lag_bound_when_batches_take_groups_in_start_order(seed, eta, group_size, groups_per_batch):
    lags, worst_excess = simulate(np.random.default_rng(seed), eta, group_size, groups_per_batch, 25, "started")
    assert worst_excess <= 0, "outstanding data exceeded (v + η + 1 - b)·B"
    assert lags and max(lags) <= eta


def test_consuming_newest_first_can_exceed_the_gate_bound():
    """Why `replay.max_age` is the hard bound: with newest-first batches a waiting group can be overtaken."""
    worst = max(
        max(simulate(np.random.default_rng(seed), 1, 2, 2, 40, order)[0])
        for seed in range(20)
        for order in ("newest", "arrival")
    )
    assert worst > 1


def _group(env: str, version: int, rng, n: int = 4) -> RolloutGroup:
    rollouts = []
    for _ in range(n):
        meta = InferenceMetadata(server="sim", version_start=version, version_end=version)
        turns = [
            Turn("user", "q", [5, 6, 7]),
            Turn(
                "assistant",
                "a",
                [8, 9],
                sampler_logprobs=[-0.5, -0.5],
                reward=float(rng.random() < 0.5),
                inference_metadata=meta,
            ),
        ]
        rollouts.append(Rollout(env, "p", turns))
    return RolloutGroup(env, "p", rollouts)


@pytest.mark.parametrize("max_staleness,max_age", [(0, 0), (1, 1), (1, 2), (2, 3)])
def test_with_the_real_buffer_and_batcher_every_trained_token_lags_at_most_max_age(max_staleness, max_age):
    """The loop's hard guarantee, on the real replay buffer and newest-first batcher driven by the gate with random
    generation times: no trained token is older than `replay.max_age` versions; what would be is dropped and
    counted."""
    rng = np.random.default_rng(max_staleness * 10 + max_age)
    group_size, B = 4, 16
    buffer = ReplayBuffer("e", ReplayConfig(max_age=max_age, min_group_size=1))
    batcher = Batcher(BatcherConfig(total_token_budget=B * 5, max_seq_len=5, min_fill=1.0), {"e": buffer})
    gate = StalenessGate(max_staleness, group_size)
    served = formed = 0
    in_flight = collections.deque()
    broadcasts = []  # (tick, version): a learner step ends and its weights reach the servers 1-4 ticks later
    lags = []
    for tick in range(400):
        for g in [g for g in in_flight if g[0] <= tick]:
            in_flight.remove(g)
            buffer.admit(_group("e", g[1], rng, group_size))
        served = max([served] + [v for t, v in broadcasts if t <= tick])
        training = any(v > served for _, v in broadcasts)
        made = None if training else batcher.try_make_batch(formed)
        if isinstance(made, FormedBatch):
            lags.extend((formed - made.batch.token_versions[made.batch.loss_mask]).tolist())
            formed += 1
            broadcasts.append((tick + int(rng.integers(1, 5)), formed))
        state = GateInputs(served, formed, len(in_flight) * group_size, len(buffer), B)
        for _ in range(gate.groups_allowed(state)):
            in_flight.append((tick + int(rng.integers(1, 8)), served))
    assert formed > 20 and lags
    assert max(lags) <= max_age
    assert buffer.metrics(formed)["replays/e/rollouts_in_buffer"] <= (max_staleness + 2) * B


# ---- step hooks ---------------------------------------------------------------------------------------------------


def test_step_hooks_run_on_their_cadence_at_the_end_and_when_stopping_in_order():
    from marin_rl.orchestrator.hooks import StepHook, StepHooks

    calls = []

    def record(name):
        def run(step):
            calls.append((name, step))
            return {f"{name}/step": step}

        return run

    hooks = StepHooks(
        [
            StepHook("broadcast", 1, record("broadcast")),
            StepHook("eval", 3, record("eval")),
            StepHook("export", 0, record("export")),
            StepHook("checkpoint", 4, record("checkpoint"), at_end=False, when_stopping=True),
        ]
    )
    for step in range(1, 7):
        metrics = hooks.run(step, last=step == 6, stopping=step == 5)
        assert set(metrics) == {k for name, s in calls if s == step for k in (f"{name}/step", f"time/hooks/{name}_s")}
    assert calls == [
        ("broadcast", 1),
        ("broadcast", 2),
        ("broadcast", 3),
        ("eval", 3),
        ("broadcast", 4),
        ("checkpoint", 4),
        ("broadcast", 5),
        ("checkpoint", 5),
        ("broadcast", 6),
        ("eval", 6),
        ("export", 6),
    ]
    with pytest.raises(ValueError, match="unique"):
        StepHooks([StepHook("a", 1, record("a")), StepHook("a", 2, record("a"))])


def test_step_hooks_split_lets_only_hooks_without_the_learner_overlap_the_next_step_and_keeps_their_order():
    from marin_rl.orchestrator.hooks import StepHook, StepHooks

    def hook(name, every, uses_learner):
        return StepHook(name, every, lambda step: None, uses_learner=uses_learner)

    hooks = StepHooks(
        [
            hook("publish", 1, True),
            hook("broadcast", 1, False),
            hook("eval", 2, False),
            hook("export", 0, True),
            hook("checkpoint", 3, True),
        ]
    )

    def names(step, last=False):
        before, during = hooks.split(step, last)
        return [h.name for h in before], [h.name for h in during]

    assert names(1) == (["publish"], ["broadcast"])
    assert names(2) == (["publish"], ["broadcast", "eval"])
    # a checkpoint needs the learner after the servers' update and the evaluation: nothing may overlap
    assert names(3) == (["publish", "broadcast", "checkpoint"], [])
    assert names(4, last=True) == (["publish", "broadcast", "eval", "export", "checkpoint"], [])
    only_eval = StepHooks([hook("eval", 1, False)])
    before, during = only_eval.split(1, False)
    assert before == [] and [h.name for h in during] == ["eval"]
