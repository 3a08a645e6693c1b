"""Every rollout path validates with the same check (`marin_rl.replay.validation.check_group`): a malformed group is
refused with the same reason code by the orchestrator's replay buffer (`ReplayBuffer.admit`), by the public API's
batches (`InferenceEngine.prepare_batch`, which drives the same controller and replay buffer, counted under
`rejected/{reason}`) and by `make_batch`.

The engine here runs a scripted workflow that returns prepared groups without sampling, over an address nothing
listens on (no inference server is started, and the test checks that no request was sent)."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from marin_rl.api import EngineConfig, InferenceEngine, make_batch
from marin_rl.envs.base import Environment, Problem
from marin_rl.replay.advantages import GroupScores, register_estimator
from marin_rl.replay.batcher import BatcherConfig
from marin_rl.replay.buffer import ReplayBuffer, ReplayConfig
from marin_rl.replay.validation import GroupRejected, check_group
from marin_rl.types import InferenceMetadata, Rollout, RolloutGroup, Turn

ENV = "scripted"
VOCAB = 100
GROUP_SIZE = 2


def make_rollout(problem_id, rng, *, env=ENV, version=0, token=None, drop_logprob=False):
    """A prompt turn and one sampled turn of 4 tokens. `token`: the sampled turn's first token id; `drop_logprob`:
    one logprob fewer than sampled tokens."""
    gen = rng.integers(4, 50, 4).tolist()
    if token is not None:
        gen[0] = token
    logprobs = (-rng.random(len(gen))).tolist()
    if drop_logprob:
        logprobs = logprobs[:-1]
    meta = InferenceMetadata(server="s", version_start=version, version_end=max(version, 0))
    turns = [
        Turn("user", "q", rng.integers(4, 50, 3).tolist()),
        Turn(
            "assistant", "a", gen, sampler_logprobs=logprobs, reward=float(rng.integers(0, 2)), inference_metadata=meta
        ),
    ]
    return Rollout(environment=env, problem_id=problem_id, turns=turns)


def make_group(kind, problem_id, rng):
    """A group of GROUP_SIZE rollouts of `problem_id`; `kind` 'valid' or the reason code its one bad rollout earns."""
    good = make_rollout(problem_id, rng)
    if kind == "valid":
        bad = make_rollout(problem_id, rng)
    elif kind == "logprob_count":
        bad = make_rollout(problem_id, rng, drop_logprob=True)
    elif kind == "token_out_of_vocab":
        bad = make_rollout(problem_id, rng, token=VOCAB)  # one past the last id of the vocabulary
    elif kind == "missing_metadata":
        bad = make_rollout(problem_id, rng, version=-1)  # sampled by unversioned (initial, unpublished) weights
    elif kind == "inconsistent_group":
        bad = make_rollout("another-problem", rng)
    elif kind == "unknown_environment":
        rs = [make_rollout(problem_id, rng, env="elsewhere") for _ in range(GROUP_SIZE)]
        return RolloutGroup(environment="elsewhere", problem_id=problem_id, rollouts=rs)
    else:
        raise ValueError(kind)
    return RolloutGroup(environment=ENV, problem_id=problem_id, rollouts=[good, bad])


BAD_KINDS = ["logprob_count", "token_out_of_vocab", "missing_metadata", "inconsistent_group", "unknown_environment"]


class ScriptedWorkflow(Environment):
    """Returns the prepared group of each problem (by id) without calling the policy."""

    name = ENV

    def __init__(self, groups: dict[str, RolloutGroup]):
        super().__init__(tokenizer=None)
        self.groups = groups
        self.policies = []

    def train_problems(self):
        return [Problem(pid, "q", "a") for pid in self.groups]

    def eval_problems(self):
        return []

    async def run_episode(self, policy, problem, sampling):
        raise AssertionError("the scripted workflow never samples")

    async def run_group(self, policy, problem, group_size, sampling):
        self.policies.append(policy)
        assert group_size == GROUP_SIZE
        return self.groups[problem.id]


def replay_reasons(groups: dict[str, RolloutGroup]) -> dict[str, str | None]:
    """What a run's replay buffer for ENV (with the vocabulary) says of each group: None (accepted) or the reason."""
    buffer = ReplayBuffer(ENV, ReplayConfig(min_group_size=GROUP_SIZE), vocab_size=VOCAB)
    return {pid: buffer.admit(g).reason for pid, g in groups.items()}


ROLLOUT_TOKENS = 7  # a prompt turn of 3 tokens and a sampled turn of 4


def engine(max_staleness=1, groups_per_batch=2, vocab_size=VOCAB, replay=None):
    """An engine over an address nothing listens on, serving version 0, whose batches are `groups_per_batch` groups:
    rows of 16 tokens (two rollouts each), filled to at least 80% (so one group fewer never makes a batch)."""
    rows = groups_per_batch * GROUP_SIZE // 2
    config = EngineConfig(
        group_size=GROUP_SIZE,
        max_staleness=max_staleness,
        replay=replay or ReplayConfig(min_group_size=GROUP_SIZE),
        batcher=BatcherConfig(total_token_budget=16 * rows, max_seq_len=16, min_fill=0.8),
        request_timeout_s=5.0,
    )
    inference = InferenceEngine(addresses=["127.0.0.1:1"], config=config, vocab_size=vocab_size)
    inference.set_version(0)  # the servers serve a policy version (prepare_batch refuses to start before)
    return inference


def batch_group_ids(formed) -> list[str]:
    """The groups a formed batch trained, each once, in first-placed order."""
    return list(dict.fromkeys(item.group_id for item, _ in formed.placed))


def wait_for(predicate, timeout=10.0):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def assert_no_request_sent(inference: InferenceEngine, workflow: ScriptedWorkflow):
    # every policy the workflow was handed is the engine's train client, and it sent nothing
    assert workflow.policies and all(p is inference.client for p in workflow.policies)
    assert inference.client.requests == 0 and inference.client.retried_requests == 0


# ---- the replay buffer ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", BAD_KINDS)
def test_the_replay_buffer_rejects_each_malformed_group_with_its_reason(kind):
    rng = np.random.default_rng(0)
    group = make_group(kind, "p", rng)
    buffer = ReplayBuffer(ENV, ReplayConfig(min_group_size=GROUP_SIZE), vocab_size=VOCAB)
    admission = buffer.admit(group)
    assert not admission.accepted and admission.reason == kind, admission
    assert buffer.metrics(0)[f"replays/{ENV}/rejected/{kind}"] == 1 and len(buffer) == 0
    with pytest.raises(GroupRejected) as e:  # the one check behind it, importable from both modules
        check_group(group, ENV, VOCAB)
    assert e.value.reason == kind
    assert buffer.admit(make_group("valid", "p", rng)).accepted


def test_check_group_without_a_vocabulary_checks_only_that_token_ids_are_non_negative():
    rng = np.random.default_rng(1)
    check_group(make_group("token_out_of_vocab", "p", rng), ENV, None)  # id VOCAB: fine without a vocabulary
    group = make_group("valid", "p", rng)
    group.rollouts[1].turns[1].token_ids[0] = -1
    with pytest.raises(GroupRejected) as e:
        check_group(group, ENV, None)
    assert e.value.reason == "token_out_of_vocab"


# ---- the InferenceEngine's batches: the run's replay buffer admits ------------------------------------------------
def test_prepare_batch_trains_only_valid_groups_and_counts_the_rest_under_the_replay_buffers_reasons(caplog):
    rng = np.random.default_rng(2)
    kinds = [*BAD_KINDS, "valid", "valid"]  # the malformed ones start (and finish) first
    groups = {f"p{i}": make_group(kind, f"p{i}", rng) for i, kind in enumerate(kinds)}
    expected = replay_reasons(groups)
    assert [expected[pid] for pid in groups] == [*BAD_KINDS, None, None]
    workflow = ScriptedWorkflow(groups)
    caplog.clear()  # the reference buffer's own lines
    with caplog.at_level(logging.WARNING, logger="marin_rl.replay.buffer"), engine() as inference:
        formed = inference.prepare_batch(workflow, workflow.train_problems(), timeout=20)
        assert sorted(batch_group_ids(formed)) == sorted(groups[pid].group_id for pid in ("p5", "p6"))
        assert formed.num_rollouts == 2 * GROUP_SIZE and int(formed.batch.loss_mask.sum()) == 2 * GROUP_SIZE * 4
        rejected = {k: v for k, v in inference.counters.items() if k.startswith("rejected/")}
        assert rejected == {f"rejected/{expected[pid]}": 1 for pid in groups if expected[pid] is not None}
        assert inference.counters["accepted"] == 2 and inference.counters["failed"] == 0
        stats = inference.stats()
        assert all(stats[f"groups/rejected/{kind}"] == 1 for kind in BAD_KINDS)
        assert stats["in_flight_rollouts"] == 0 and stats["buffered_rollouts"] == 0
        assert_no_request_sent(inference, workflow)
    warnings = [r.getMessage() for r in caplog.records if r.name == "marin_rl.replay.buffer"]
    for kind in BAD_KINDS:
        [line] = [w for w in warnings if f"({kind})" in w]
        assert "rejected a group" in line and "\n" not in line


def test_an_invalid_group_frees_its_room_in_the_gate():
    """η = 0 and one group per batch: the gate lets one group run at a time. Invalid groups must give their room
    back (or the valid group behind them would never start)."""
    rng = np.random.default_rng(3)
    kinds = ["logprob_count", "token_out_of_vocab", "logprob_count", "valid"]
    groups = {f"p{i}": make_group(kind, f"p{i}", rng) for i, kind in enumerate(kinds)}
    workflow = ScriptedWorkflow(groups)
    with engine(max_staleness=0, groups_per_batch=1) as inference:
        formed = inference.prepare_batch(workflow, workflow.train_problems(), timeout=20)
        assert batch_group_ids(formed) == [groups["p3"].group_id]
        assert inference.counters["rejected/logprob_count"] == 2
        assert inference.counters["rejected/token_out_of_vocab"] == 1
        assert inference.counters["started"] == 4 and inference.stats()["in_flight_rollouts"] == 0
        assert_no_request_sent(inference, workflow)


def test_the_vocabulary_check_follows_vocab_size():
    rng = np.random.default_rng(4)
    groups = {"bad": make_group("token_out_of_vocab", "bad", rng), "good": make_group("valid", "good", rng)}
    workflow = ScriptedWorkflow(groups)
    with engine(groups_per_batch=1) as inference:
        formed = inference.prepare_batch(workflow, workflow.train_problems(), timeout=20)
        assert batch_group_ids(formed) == [groups["good"].group_id]
        assert inference.counters["rejected/token_out_of_vocab"] == 1
    with engine(groups_per_batch=1, vocab_size=None) as inference:  # no vocabulary: ids need only be >= 0
        formed = inference.prepare_batch(workflow, [workflow.train_problems()[0]], timeout=20)
        assert batch_group_ids(formed) == [groups["bad"].group_id]
        assert not any(k.startswith("rejected") for k in inference.counters)


def test_a_registered_estimator_decides_admission_like_in_a_run():
    """A custom admission rule is an estimator that rejects: its reason is counted like the built-in ones, and the
    advantages of what it accepts are the ones trained."""

    @register_estimator("best_only_test")
    def best_only(group, state):
        rewards = group.rewards
        if rewards.max() <= 0:
            return GroupScores.reject("no_success", "no rollout of the group was rewarded")
        return GroupScores((rewards == rewards.max()).astype(np.float64))

    rng = np.random.default_rng(6)
    groups = {f"p{i}": make_group("valid", f"p{i}", rng) for i in range(6)}
    for group in groups.values():
        rewards = group.rewards
        for rollout, reward in zip(group.rollouts, rewards, strict=True):
            assert rollout.reward == reward
    successes = [pid for pid, g in groups.items() if g.rewards.max() > 0]
    assert 2 <= len(successes) < len(groups)
    workflow = ScriptedWorkflow(groups)
    replay = ReplayConfig(min_group_size=GROUP_SIZE, advantage_estimator="best_only_test")
    with engine(replay=replay) as inference:
        formed = inference.prepare_batch(workflow, workflow.train_problems(), timeout=20)
        assert set(batch_group_ids(formed)) <= {groups[pid].group_id for pid in successes}
        for item, _ in formed.placed:
            assert item.advantage == float(
                item.rollout.reward == max(r.reward for r in groups[item.rollout.problem_id].rollouts)
            )
        rejected = {k: v for k, v in inference.counters.items() if k.startswith("rejected/")}
        assert set(rejected) == {"rejected/no_success"}  # p1 and p2 (seeded) precede the second success, p5 may be in
        assert 2 <= rejected["rejected/no_success"] <= 3


class FailingWorkflow(ScriptedWorkflow):
    async def run_group(self, policy, problem, group_size, sampling):
        raise ConnectionError("the sandbox went away")


def test_a_failed_episode_raises_from_prepare_batch_and_its_problem_is_handed_out_again():
    workflow = FailingWorkflow({"p0": make_group("valid", "p0", np.random.default_rng(7))})
    with engine(groups_per_batch=1) as inference:
        with pytest.raises(
            RuntimeError, match=r"a group of scripted failed: ConnectionError\('the sandbox went away'\)"
        ):
            inference.prepare_batch(workflow, workflow.train_problems(), timeout=20)
        assert inference.counters["failed"] == 1
        assert inference.rollouts.pools[ENV].iterator.next().index == 0  # first in line again


def test_prepare_batch_raises_stop_iteration_when_the_problems_run_out():
    rng = np.random.default_rng(8)
    workflow = ScriptedWorkflow({"p0": make_group("valid", "p0", rng)})
    with engine(groups_per_batch=2) as inference, pytest.raises(StopIteration, match="ran out"):
        inference.prepare_batch(workflow, workflow.train_problems(), timeout=20)


def test_batches_before_any_policy_version_is_served_are_refused_in_one_line():
    workflow = ScriptedWorkflow({"good": make_group("valid", "good", np.random.default_rng(5))})
    config = EngineConfig(group_size=GROUP_SIZE, request_timeout_s=5.0)
    with InferenceEngine(addresses=["127.0.0.1:1"], config=config, vocab_size=VOCAB) as inference:
        with pytest.raises(RuntimeError, match=r"serve a policy version first: call TrainEngine.update_weights"):
            inference.prepare_batch(workflow, workflow.train_problems(), timeout=1)
        assert inference.counters["started"] == 0


# ---- make_batch ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["logprob_count", "missing_metadata", "inconsistent_group"])
def test_make_batch_raises_on_a_malformed_group_naming_it_and_its_reason(kind):
    rng = np.random.default_rng(5)
    valid = [make_group("valid", f"p{i}", rng) for i in range(2)]
    batch = make_batch(valid, 4, 16)
    assert int(batch.loss_mask.sum()) == 4 * GROUP_SIZE * len(valid)
    bad = make_group(kind, "q", rng)
    with pytest.raises(ValueError, match=rf"group {bad.group_id} .*\({kind}\)"):
        make_batch([*valid, bad], 4, 16)
