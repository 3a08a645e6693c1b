"""Per-turn group advantages ('turn_rloo'): a reference written from the definition, the rollout → token mapping, and
the replay buffer carrying per-token advantages into batches, checkpoints and the rollout store."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marin_rl.learner.algorithm import get_algorithm
from marin_rl.replay.advantages import GroupAdvantages, policy_turns, rloo, turn_rloo, turn_rloo_token_advantages
from marin_rl.replay.batcher import Batcher, BatcherConfig
from marin_rl.replay.buffer import ReplayBuffer, ReplayConfig
from marin_rl.replay.store import read_rollouts
from marin_rl.types import InferenceMetadata, Rollout, RolloutGroup, Turn


def reference(step_rewards, lam):
    """Straight from the definition: V_i,k = mean over j≠i reaching turn k of Σ_{m≥k} r_j,m (0 if none, 0 after the
    last turn); A_i,k = Σ_m λ^m δ_i,k+m with δ_i,k = r_i,k + V_i,k+1 − V_i,k."""
    n = len(step_rewards)
    if n < 2:
        return [[0.0] * len(r) for r in step_rewards]

    def value(i, k):
        if k >= len(step_rewards[i]):
            return 0.0
        others = [sum(step_rewards[j][k:]) for j in range(n) if j != i and len(step_rewards[j]) > k]
        return sum(others) / len(others) if others else 0.0

    out = []
    for i, r in enumerate(step_rewards):
        deltas = [r[k] + value(i, k + 1) - value(i, k) for k in range(len(r))]
        out.append([sum(lam**m * deltas[k + m] for m in range(len(r) - k)) for k in range(len(r))])
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.floats(-3, 3), min_size=0, max_size=5), min_size=1, max_size=6),
    st.sampled_from([0.0, 0.5, 0.9, 1.0]),
)
def test_turn_rloo_matches_the_definition_on_ragged_groups(step_rewards, lam):
    got = turn_rloo([np.array(r) for r in step_rewards], lam)
    for g, want in zip(got, reference(step_rewards, lam), strict=True):
        np.testing.assert_allclose(g, want, atol=1e-9)


def test_turn_rloo_special_cases():
    r = np.array([1.0, 0.0, 1.0, 1.0])
    for lam in (0.0, 1.0):  # one turn: RLOO
        np.testing.assert_allclose(np.concatenate(turn_rloo([np.array([x]) for x in r], lam)), rloo(r))
    group = np.array([[1, 0, 1], [0, 1, 1], [1, 1, 0.0]])
    lam0 = turn_rloo(list(group), 0.0)  # each turn against the others' same turn
    np.testing.assert_allclose(lam0, [[0.5, -1, 0.5], [-1, 0.5, 0.5], [0.5, 0.5, -1]])
    lam1 = turn_rloo(list(group), 1.0)  # return from the turn on, against the others'
    ret = np.cumsum(group[:, ::-1], 1)[:, ::-1]
    np.testing.assert_allclose(lam1, ret - (ret.sum(0) - ret) / 2)
    assert [a.tolist() for a in turn_rloo([np.array([1.0, 2.0])], 1.0)] == [[0.0, 0.0]]  # a group of one
    with pytest.raises(ValueError, match="lambda"):
        turn_rloo(list(group), 1.5)
    with pytest.raises(ValueError, match="per turn"):
        GroupAdvantages("turn_rloo")(group.sum(1))


def multi_turn_rollout(rewards, rng, version=0, reward_on_env_turn=False):
    """user, then (assistant, user) per turn; each assistant turn's reward on it or on the user turn after it."""
    meta = InferenceMetadata(server="s", version_start=version, version_end=version)
    turns = [Turn("user", "q", rng.integers(4, 100, 3).tolist())]
    for k, r in enumerate(rewards):
        n = int(rng.integers(1, 4))
        turns.append(
            Turn(
                "assistant",
                "a",
                rng.integers(4, 100, n).tolist(),
                sampler_logprobs=(-rng.random(n)).tolist(),
                inference_metadata=meta,
                reward=0.0 if reward_on_env_turn else r,
            )
        )
        if k + 1 < len(rewards) or reward_on_env_turn:
            turns.append(Turn("user", "u", rng.integers(4, 100, 2).tolist(), reward=r if reward_on_env_turn else 0))
    return Rollout(environment="e", problem_id="p", turns=turns)


@pytest.mark.parametrize("reward_on_env_turn", [False, True])
def test_token_advantages_give_each_sampled_token_its_turns_advantage(reward_on_env_turn):
    rng = np.random.default_rng(0)
    step_rewards = [[1.0, 0.0, 1.0], [0.0, 0.0], [1.0, 1.0, 1.0]]
    rollouts = [multi_turn_rollout(r, rng, reward_on_env_turn=reward_on_env_turn) for r in step_rewards]
    for r, want in zip(rollouts, step_rewards, strict=True):
        assert policy_turns(r)[1].tolist() == want
    per_turn = turn_rloo([np.array(r) for r in step_rewards], 0.5)
    for r, tok, adv in zip(rollouts, turn_rloo_token_advantages(rollouts, 0.5), per_turn, strict=True):
        expected, k = [], 0
        for t in r.turns:
            if t.role == "assistant":
                expected += [adv[k]] * len(t.token_ids)
                k += 1
            else:
                expected += [0.0] * len(t.token_ids)
        np.testing.assert_allclose(tok, expected)


def test_buffer_carries_turn_advantages_into_batches_checkpoints_and_the_store(tmp_path):
    rng = np.random.default_rng(1)
    config = ReplayConfig(advantage_estimator="turn_rloo", turn_lambda=0.0, persist_flush_rows=1)
    buf = ReplayBuffer("e", config, vocab_size=100, rollout_dir=str(tmp_path))
    step_rewards = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    group = RolloutGroup("e", "p", [multi_turn_rollout(r, rng) for r in step_rewards])
    assert buf.admit(group).accepted
    buf.flush()
    want = turn_rloo_token_advantages(group.rollouts, 0.0)
    for it, w, r in zip(buf.items, want, group.rollouts, strict=True):
        np.testing.assert_allclose(it.token_advantages, w, atol=1e-7)
        assert it.advantage == pytest.approx(w[r.loss_mask()].mean())
    restored = ReplayBuffer("e", config, vocab_size=100)
    restored.load_state_dict(buf.state_dict())
    for a, b in zip(restored.items, buf.items, strict=True):
        np.testing.assert_array_equal(a.token_advantages, b.token_advantages)
    stored = read_rollouts(str(tmp_path)).rollouts
    assert len(stored) == 4
    by_uid = {r.rollout_uid: w for r, w in zip(group.rollouts, want, strict=True)}
    for s in stored:
        np.testing.assert_allclose(s.token_advantages, by_uid[s.rollout.rollout_uid], atol=1e-6)
    batcher = Batcher(
        BatcherConfig(total_token_budget=4 * 32, max_seq_len=32, min_fill=0.1), {"e": restored}, {"e": 1.0}
    )
    batch = batcher.try_make_batch(0).batch  # every sampled token carries its turn's advantage, the others 0
    expected = np.concatenate([w[r.loss_mask()] for w, r in zip(want, group.rollouts, strict=True)])
    np.testing.assert_allclose(np.sort(batch.advantages[batch.loss_mask]), np.sort(expected), atol=1e-6)
    assert not batch.advantages[~batch.loss_mask].any()


def test_turn_rloo_is_a_shipped_algorithm_without_a_critic():
    algorithm = get_algorithm("turn_rloo")
    assert algorithm.advantage_estimator == "turn_rloo" and algorithm.roles == ("actor",)
    with pytest.raises(ValueError, match="turn_lambda"):
        ReplayConfig(advantage_estimator="turn_rloo", turn_lambda=-0.1)


def test_make_batch_takes_per_token_advantages_from_user_code():
    from marin_rl.api import make_batch

    rng = np.random.default_rng(2)
    groups = [  # the rollouts' problem is "p" (make_batch validates each group)
        RolloutGroup("e", "p", [multi_turn_rollout(r, rng) for r in ([1.0, 0.0], [0.0, 0.0], [1.0, 1.0])])
        for _ in range(2)
    ]
    batch = make_batch(groups, 6, 32, token_advantages=lambda rs: turn_rloo_token_advantages(rs, 0.0))
    per_group = [(g.rollouts, turn_rloo_token_advantages(g.rollouts, 0.0)) for g in groups]
    want = np.concatenate([a[r.loss_mask()] for rs, adv in per_group for r, a in zip(rs, adv, strict=True)])
    np.testing.assert_allclose(np.sort(batch.advantages[batch.loss_mask]), np.sort(want), atol=1e-6)
    assert not batch.advantages[~batch.loss_mask].any()
    with pytest.raises(ValueError, match="gave 1 arrays for the 3 rollouts"):
        make_batch(groups, 6, 32, token_advantages=lambda rs: [np.zeros(rs[0].num_tokens)])
