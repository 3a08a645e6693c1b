"""The advantage estimator registry: one signature, built-ins registered like user estimators, selected by name
through `ReplayBuffer`, estimator state in checkpoints under the keys older checkpoints have."""

import json
import textwrap

import numpy as np
import pytest

from marin_rl.learner.algorithm import get_algorithm
from marin_rl.replay.advantages import (
    ESTIMATOR_NAMES,
    ESTIMATORS,
    EstimatorState,
    GroupAdvantages,
    GroupScores,
    get_estimator,
    register_estimator,
    rloo,
)
from marin_rl.replay.buffer import ReplayBuffer, ReplayConfig
from marin_rl.types import InferenceMetadata, Rollout, RolloutGroup, Turn

BUILT_IN = {"rloo", "grpo", "dr_grpo", "reinforce", "remax", "turn_rloo", "gae"}


@pytest.fixture
def registry():
    """Names registered during a test leave the registry after it."""
    before = dict(ESTIMATORS)
    yield
    ESTIMATORS.clear()
    ESTIMATORS.update(before)


def group_with_rewards(rewards, rng, env="e"):
    """One prompt turn and one sampled turn (3 tokens, version 0) per reward."""
    meta = InferenceMetadata(server="s", version_start=0, version_end=0)
    rs = [
        Rollout(
            environment=env,
            problem_id="p",
            turns=[
                Turn("user", "q", rng.integers(4, 100, 2).tolist()),
                Turn(
                    "assistant",
                    "a",
                    rng.integers(4, 100, 3).tolist(),
                    sampler_logprobs=(-rng.random(3)).tolist(),
                    reward=float(r),
                    inference_metadata=meta,
                ),
            ],
        )
        for r in rewards
    ]
    return RolloutGroup(environment=env, problem_id="p", rollouts=rs)


def test_built_in_estimators_are_the_registry():
    assert BUILT_IN <= set(ESTIMATOR_NAMES) and set(ESTIMATOR_NAMES) == set(ESTIMATORS)
    for name in BUILT_IN:
        assert get_estimator(name).name == name
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*'rloo'"):
        get_estimator("ppo")


def test_a_user_estimator_is_selected_by_name_through_the_replay_buffer(registry):
    @register_estimator("test_best_only")
    def best_only(group, state):
        r = group.rewards
        if np.all(r == r[0]):
            return GroupScores.reject("all_equal", f"group {group.group_id}: every reward is {r[0]}")
        return GroupScores((r == r.max()).astype(float))

    assert "test_best_only" in ESTIMATOR_NAMES
    rng = np.random.default_rng(0)
    buf = ReplayBuffer("e", ReplayConfig(advantage_estimator="test_best_only"), vocab_size=100)
    admission = buf.admit(group_with_rewards([0.0, 1.0, 0.5], rng))
    assert admission.accepted and admission.queued == 3
    assert [it.advantage for it in buf.items] == [0.0, 1.0, 0.0]
    rejected = buf.admit(group_with_rewards([1.0, 1.0], rng))
    assert rejected.reason == "all_equal" and buf.rejected["all_equal"] == 1
    assert buf.metrics(0)["replays/e/rejected/all_equal"] == 1 and len(buf) == 3
    with pytest.raises(ValueError, match="already registered"):
        register_estimator("test_best_only")(lambda group, state: GroupScores(group.rewards))


def test_an_estimator_declares_that_it_needs_a_greedy_baseline(registry):
    """Whoever samples groups (a run's env workers through the algorithm, the API's worker pool) asks the estimator
    whether each group needs its greedy episode, not its name."""

    @register_estimator("test_half_greedy", greedy_baseline=True)
    def half_greedy(group, state):
        return GroupScores(group.rewards - 0.5 * group.baseline_reward)

    assert get_estimator("test_half_greedy").greedy_baseline and get_estimator("remax").greedy_baseline
    assert not any(get_estimator(name).greedy_baseline for name in BUILT_IN - {"remax"})
    assert get_algorithm("remax").greedy_baseline and not get_algorithm("rloo").greedy_baseline


def test_config_names_the_registered_estimators(registry):
    register_estimator("test_named")(lambda group, state: GroupScores(rloo(group.rewards)))
    with pytest.raises(ValueError, match=r"replay\.advantage_estimator: unknown .*'test_named'"):
        ReplayConfig(advantage_estimator="nope")
    ReplayConfig(advantage_estimator="test_named")


def test_an_estimator_module_is_imported_by_package_module_name(registry, tmp_path, monkeypatch):
    (tmp_path / "my_estimators_mod.py").write_text(
        textwrap.dedent(
            """
            from marin_rl.replay.advantages import EstimatorState, GroupScores, register_estimator


            class Count(EstimatorState):
                def __init__(self, options):
                    super().__init__(options)
                    self.groups = 0

                def state_dict(self):
                    return {"test_groups_seen": self.groups}

                def load_state_dict(self, state):
                    self.groups = int(state.get("test_groups_seen", self.groups))

                def metrics(self):
                    return {"test_groups_seen": self.groups}


            @register_estimator("test_counted", state=Count)
            def counted(group, state):
                state.groups += 1
                return GroupScores(group.rewards - state.groups)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = ReplayConfig(advantage_estimator="my_estimators_mod:test_counted")
    rng = np.random.default_rng(1)
    buf = ReplayBuffer("e", cfg)
    for _ in range(2):
        assert buf.admit(group_with_rewards([1.0, 0.0], rng)).accepted
    assert [it.advantage for it in buf.items] == [0.0, -1.0, -1.0, -2.0]
    state = json.loads(json.dumps(buf.state_dict()))
    assert state["test_groups_seen"] == 2 and buf.metrics(0)["replays/e/test_groups_seen"] == 2
    again = ReplayBuffer("e", cfg)
    again.load_state_dict(state)
    assert again.advantages.groups == 2
    with pytest.raises(ValueError, match="cannot import"):
        ReplayConfig(advantage_estimator="no_such_module_here:x")


def test_reinforce_state_keeps_its_checkpoint_key_and_older_checkpoints_load():
    rng = np.random.default_rng(2)
    buf = ReplayBuffer("e", ReplayConfig(advantage_estimator="reinforce", reinforce_baseline_decay=0.5))
    for _ in range(3):
        buf.admit(group_with_rewards(rng.integers(0, 3, 3), rng))
    state = json.loads(json.dumps(buf.state_dict()))
    assert state["reinforce_baseline"] == buf.advantages.baseline != 0.0
    assert set(state) == {
        "env_name",
        "items",
        "learner_version",
        "rejected",
        "accepted_groups",
        "discarded_stale",
        "evicted",
        "dropped",
        "truncated_too_long",
        "segment",
        "reinforce_baseline",
        "sampling",  # the sampled vs trained counts of dynamic sampling's oversampling metrics
    }
    assert buf.metrics(0)["replays/e/reinforce_baseline"] == buf.advantages.baseline
    restored = ReplayBuffer("e", ReplayConfig(advantage_estimator="reinforce", reinforce_baseline_decay=0.5))
    restored.load_state_dict(state)
    assert restored.advantages.baseline == buf.advantages.baseline and len(restored) == len(buf)
    # a checkpoint from before the registry: every buffer wrote 'reinforce_baseline', whatever its estimator
    rloo_buf = ReplayBuffer("e", ReplayConfig())
    rloo_buf.admit(group_with_rewards(rng.integers(0, 3, 3), rng))
    old = {**json.loads(json.dumps(rloo_buf.state_dict())), "reinforce_baseline": 0.0}
    del old["sampling"]  # and no sampling counts (they came later)
    ReplayBuffer("e", ReplayConfig()).load_state_dict(old)
    assert "replays/e/reinforce_baseline" not in rloo_buf.metrics(0)


def test_estimators_that_miscount_are_refused(registry):
    register_estimator("test_short")(lambda group, state: GroupScores(group.rewards[:-1]))
    rng = np.random.default_rng(3)
    with pytest.raises(ValueError, match="gave 1 advantages for 2 rollouts"):
        ReplayBuffer("e", ReplayConfig(advantage_estimator="test_short")).admit(group_with_rewards([1.0, 0.0], rng))


def test_the_rewards_only_call_matches_scoring_the_group():
    rng = np.random.default_rng(4)
    group = group_with_rewards([1.0, 0.0, 0.25, 1.0], rng)
    for name in ("rloo", "grpo", "dr_grpo", "reinforce", "gae"):
        a, b = GroupAdvantages(name), GroupAdvantages(name)
        np.testing.assert_allclose(a(group.rewards), b.score(group).advantages)
    assert isinstance(GroupAdvantages("rloo").state, EstimatorState)
    group.baseline_reward = 0.5
    np.testing.assert_allclose(GroupAdvantages("remax")(group.rewards, 0.5), group.rewards - 0.5)
    turn = GroupAdvantages("turn_rloo").score(group)
    assert turn.token_advantages is not None and len(turn.token_advantages) == 4
    np.testing.assert_allclose(turn.advantages, rloo(group.rewards))  # one turn: RLOO on each sampled token
