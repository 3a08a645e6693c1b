"""Every rollout path validates with the same check (`marin_rl.replay.validation.check_group`): a malformed group is
refused with the same reason code by the orchestrator's replay buffer (`ReplayBuffer.admit`), by the public API's
gated path (`InferenceEngine.prepare_batch` / `wait`, counted under `rejected/{reason}`) and by `make_batch`.

The engine here runs a scripted workflow that returns prepared groups without sampling, over an address nothing
listens on (no inference server is started, and the test checks that no request was sent)."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from marin_rl.api import EngineConfig, InferenceEngine, make_batch
from marin_rl.envs.base import Environment, Problem
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


def engine(max_staleness=1, batch_size=2, vocab_size=VOCAB):
    config = EngineConfig(
        group_size=GROUP_SIZE, batch_size=batch_size, max_staleness=max_staleness, request_timeout_s=5.0
    )
    inference = InferenceEngine(addresses=["127.0.0.1:1"], config=config, vocab_size=vocab_size)
    inference.set_version(0)  # the servers serve a policy version (gated work refuses to start before)
    return inference


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


# ---- the InferenceEngine's gated path -----------------------------------------------------------------------
def test_prepare_batch_hands_out_only_valid_groups_and_counts_the_rest_under_the_replay_buffers_reasons(caplog):
    rng = np.random.default_rng(2)
    kinds = [*BAD_KINDS, "valid", "valid"]  # the malformed ones start (and finish) first
    groups = {f"p{i}": make_group(kind, f"p{i}", rng) for i, kind in enumerate(kinds)}
    expected = replay_reasons(groups)
    assert [expected[pid] for pid in groups] == [*BAD_KINDS, None, None]
    workflow = ScriptedWorkflow(groups)
    with caplog.at_level(logging.WARNING, logger="marin_rl.api.gated_rollouts"), engine() as inference:
        batch = inference.prepare_batch(workflow.train_problems(), workflow, timeout=20)
        wait_for(lambda: inference.counters["finished"] == len(kinds))
        assert sorted(g.group_id for g in batch) == sorted(groups[pid].group_id for pid in ("p5", "p6"))
        rejected = {k: v for k, v in inference.counters.items() if k.startswith("rejected/")}
        assert rejected == {f"rejected/{expected[pid]}": 1 for pid in groups if expected[pid] is not None}
        assert inference.counters["accepted"] == 2 and inference.counters["failed"] == 0
        stats = inference.stats()
        assert all(stats[f"groups/rejected/{kind}"] == 1 for kind in BAD_KINDS)
        assert stats["in_flight_rollouts"] == 0 and stats["finished_groups"] == 0
        assert_no_request_sent(inference, workflow)
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "marin_rl.api.gated_rollouts" and r.levelno == logging.WARNING
    ]
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
    with engine(max_staleness=0, batch_size=1) as inference:
        [group] = inference.prepare_batch(workflow.train_problems(), workflow, timeout=20)
        assert group is groups["p3"]
        assert inference.counters["rejected/logprob_count"] == 2
        assert inference.counters["rejected/token_out_of_vocab"] == 1
        assert inference.counters["started"] == 4 and inference.stats()["in_flight_rollouts"] == 0
        assert_no_request_sent(inference, workflow)


def test_wait_never_returns_an_invalid_group_and_the_vocabulary_check_follows_vocab_size():
    rng = np.random.default_rng(4)
    groups = {"bad": make_group("token_out_of_vocab", "bad", rng), "good": make_group("valid", "good", rng)}
    workflow = ScriptedWorkflow(groups)
    problems = {p.id: p for p in workflow.train_problems()}
    with engine() as inference:
        inference.submit(problems["bad"], workflow)
        inference.submit(problems["good"], workflow)
        [result] = inference.wait(1, timeout=20)
        assert result.group is groups["good"]
        with pytest.raises(TimeoutError):
            inference.wait(1, timeout=0.3)
        assert inference.counters["rejected/token_out_of_vocab"] == 1
    with engine(vocab_size=None) as inference:  # no vocabulary known: ids need only be non-negative integers
        inference.submit(problems["bad"], workflow)
        [result] = inference.wait(1, timeout=20)
        assert result.group is groups["bad"] and not any(k.startswith("rejected") for k in inference.counters)


def test_gated_work_before_any_policy_version_is_served_is_refused_in_one_line():
    workflow = ScriptedWorkflow({"good": make_group("valid", "good", np.random.default_rng(5))})
    config = EngineConfig(group_size=GROUP_SIZE, batch_size=1, request_timeout_s=5.0)
    with InferenceEngine(addresses=["127.0.0.1:1"], config=config, vocab_size=VOCAB) as inference:
        with pytest.raises(RuntimeError, match=r"serve a policy version first: call TrainEngine.update_weights"):
            inference.submit(workflow.train_problems()[0], workflow)
        with pytest.raises(RuntimeError, match=r"serve a policy version first"):
            inference.prepare_batch(workflow.train_problems(), workflow, timeout=1)
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
