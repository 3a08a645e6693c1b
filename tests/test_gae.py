"""GAE against references written from the definitions (explicit discounted sums), for multi-turn episodes with
environment tokens, truncation and packed rows."""

import numpy as np
import pytest

from marin_rl.replay.gae import gae, gae_packed, token_rewards, whiten
from marin_rl.types import InferenceMetadata, Rollout, Turn


def _reference(rewards, values, mask, gamma, lam, bootstrap=0.0, lam_between=None):
    """A_k = Σ_l (Π_{j<l} γλ_{k+j}) δ_{k+l} over the sampled tokens only, δ_k = r_k + γ V_{k+1} − V_k, V_n =
    bootstrap; λ_k is `lam_between` where a token that was not sampled lies between sampled tokens k and k+1."""
    idx = [i for i in range(len(mask)) if mask[i]]
    v = [values[i] for i in idx] + [bootstrap]
    deltas = [rewards[i] + gamma * v[k + 1] - v[k] for k, i in enumerate(idx)]
    lams = [
        lam if lam_between is None or k + 1 == len(idx) or idx[k + 1] == i + 1 else lam_between
        for k, i in enumerate(idx)
    ]
    adv, ret = np.zeros(len(mask)), np.zeros(len(mask))
    for k, i in enumerate(idx):
        adv[i] = sum(np.prod([gamma * x for x in lams[k : k + j]]) * deltas[k + j] for j in range(len(idx) - k))
        ret[i] = adv[i] + values[i]
    return adv, ret


def _episode(rng, length=30):
    mask = rng.random(length) < 0.6
    rewards = np.where(mask & (rng.random(length) < 0.3), rng.normal(size=length), 0.0)
    return rewards, rng.normal(size=length), mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
@pytest.mark.parametrize("bootstrap", [0.0, 1.7])
def test_gae_matches_the_discounted_sum_of_td_errors(gamma, lam, bootstrap):
    rng = np.random.default_rng(0)
    for _ in range(5):
        rewards, values, mask = _episode(rng)
        adv, ret = gae(rewards, values, mask, gamma, lam, bootstrap_value=bootstrap)
        ref_adv, ref_ret = _reference(rewards, values, mask, gamma, lam, bootstrap)
        np.testing.assert_allclose(adv, ref_adv, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(ret, ref_ret, rtol=1e-10, atol=1e-12)
        assert np.all(adv[~mask] == 0) and np.all(ret[~mask] == 0)


@pytest.mark.parametrize("gamma,lam,lam_between", [(1.0, 1.0, 0.0), (0.99, 0.95, 0.3), (0.9, 0.0, 1.0)])
def test_lambda_between_turns_matches_the_sum_of_td_errors(gamma, lam, lam_between):
    rng = np.random.default_rng(3)
    for _ in range(5):
        rewards, values, mask = _episode(rng)
        adv, ret = gae(rewards, values, mask, gamma, lam, bootstrap_value=0.4, lam_between_turns=lam_between)
        ref_adv, ref_ret = _reference(rewards, values, mask, gamma, lam, 0.4, lam_between)
        np.testing.assert_allclose(adv, ref_adv, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(ret, ref_ret, rtol=1e-10, atol=1e-12)


def test_lambda_one_within_and_zero_between_turns_credits_each_turn_alone():
    """Each token gets the rewards left in its own turn plus V(first token of the next turn) − V(itself): no later
    turn's reward reaches it."""
    #                  turn 1 (3 tokens) | env | turn 2 (2 tokens) | env | turn 3
    mask = np.array([False, True, True, True, False, True, True, False, False, True])
    rewards = np.array([0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    values = np.array([9.0, 0.5, 0.6, 0.7, 9.0, 0.2, 0.3, 9.0, 9.0, 0.8])
    adv, _ = gae(rewards, values, mask, 1.0, 1.0, lam_between_turns=0.0)
    expected = [0, 1 + 0.2 - 0.5, 1 + 0.2 - 0.6, 1 + 0.2 - 0.7, 0, 0.8 - 0.2, 0.8 - 0.3, 0, 0, 1 - 0.8]
    np.testing.assert_allclose(adv, expected, atol=1e-12)
    adv_episode, _ = gae(rewards, values, mask, 1.0, 1.0)  # plain λ = 1: every later reward counts
    np.testing.assert_allclose(adv_episode[1], 2 - 0.5)


def test_environment_tokens_neither_get_advantage_nor_break_the_recursion():
    """The same episode with its environment tokens removed gives the same advantages on the sampled tokens."""
    rng = np.random.default_rng(1)
    rewards, values, mask = _episode(rng, 40)
    adv, _ = gae(rewards, values, mask, 0.97, 0.9, bootstrap_value=0.3)
    adv_sampled_only, _ = gae(rewards[mask], values[mask], np.ones(mask.sum(), bool), 0.97, 0.9, 0.3)
    np.testing.assert_allclose(adv[mask], adv_sampled_only, rtol=1e-12)


def test_no_critic_and_no_discount_gives_the_rewards_to_go():
    rewards = np.array([0.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.0])
    mask = np.array([False, True, True, False, True, True, False])
    adv, ret = gae(rewards, np.zeros(7), mask, 1.0, 1.0)
    np.testing.assert_allclose(adv, [0, 1.5, 1.5, 0, 0.5, 0.5, 0])
    np.testing.assert_allclose(ret, adv)


def test_truncated_episode_bootstraps_from_the_last_state_value():
    rewards, values, mask = np.array([0.0, 0.0]), np.array([0.2, 0.4]), np.array([True, True])
    adv, _ = gae(rewards, values, mask, 0.9, 1.0, bootstrap_value=2.0)
    assert adv[1] == pytest.approx(0.9 * 2.0 - 0.4)
    assert adv[0] == pytest.approx((0.9 * 0.4 - 0.2) + 0.9 * adv[1])


@pytest.mark.parametrize("lam_between", [None, 0.2])
def test_packed_rows_equal_each_episode_alone(lam_between):
    rng = np.random.default_rng(2)
    rows, positions = 3, 50
    segs = np.full((rows, positions), -1)
    rewards, values, mask = (
        np.zeros((rows, positions)),
        rng.normal(size=(rows, positions)),
        np.zeros((rows, positions), bool),
    )
    boot = np.zeros((rows, positions))
    episodes = []
    for r in range(rows):
        start, seg = 0, 0
        while True:
            length = int(rng.integers(3, 15))
            if start + length > positions - 2:
                break
            ep_r, _, ep_m = _episode(rng, length)
            sl = slice(start, start + length)
            segs[r, sl], rewards[r, sl], mask[r, sl] = seg, ep_r, ep_m
            b = float(rng.normal()) if rng.random() < 0.5 else 0.0  # half the episodes were truncated
            boot[r, start + length - 1] = b
            episodes.append((r, sl, b))
            start, seg = start + length, seg + 1
    adv, ret = gae_packed(rewards, values, mask, segs, 0.95, 0.9, boot, lam_between)
    for r, sl, b in episodes:
        ref_adv, ref_ret = _reference(rewards[r, sl], values[r, sl], mask[r, sl], 0.95, 0.9, b, lam_between)
        np.testing.assert_allclose(adv[r, sl], ref_adv, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(ret[r, sl], ref_ret, rtol=1e-10, atol=1e-12)
    assert np.all(adv[segs < 0] == 0)


def test_rewards_off_the_sampled_tokens_and_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="sampled tokens"):
        gae(np.array([1.0, 0.0]), np.zeros(2), np.array([False, True]), 1.0, 1.0)
    with pytest.raises(ValueError, match="gamma and lambda"):
        gae(np.zeros(2), np.zeros(2), np.ones(2, bool), 1.1, 1.0)
    with pytest.raises(ValueError, match="between turns: 2.0"):
        gae(np.zeros(2), np.zeros(2), np.ones(2, bool), 1.0, 1.0, lam_between_turns=2.0)


def _turn(role, ids, reward=0.0, sampled=False):
    meta = InferenceMetadata(server="s", version_start=0, version_end=0) if sampled else None
    return Turn(
        role=role,
        message="",
        token_ids=ids,
        sampler_logprobs=[-1.0] * len(ids) if sampled else None,
        reward=reward,
        inference_metadata=meta,
    )


def test_token_rewards_per_turn_or_at_the_end_of_a_multi_turn_episode():
    rollout = Rollout(
        environment="e",
        problem_id="p",
        turns=[
            _turn("user", [1, 2]),
            _turn("assistant", [3, 4, 5], 0.25, sampled=True),
            _turn("tool", [6, 7], 0.5),
            _turn("assistant", [8, 9], 1.0, sampled=True),
            _turn("user", [10]),
        ],
    )
    per_turn = token_rewards(rollout, per_turn=True)
    np.testing.assert_allclose(per_turn, [0, 0, 0, 0, 0.75, 0, 0, 0, 1.0, 0])  # the tool's reward: its action's
    np.testing.assert_allclose(token_rewards(rollout, per_turn=False), [0, 0, 0, 0, 0, 0, 0, 0, 1.75, 0])
    adv, _ = gae(per_turn, np.zeros(10), rollout.loss_mask(), 1.0, 1.0)
    np.testing.assert_allclose(adv[rollout.loss_mask()], [1.75, 1.75, 1.75, 1.0, 1.0])  # per-token credit


def test_whiten_over_the_masked_tokens():
    rng = np.random.default_rng(3)
    a, m = rng.normal(3.0, 2.0, size=(4, 20)), rng.random((4, 20)) < 0.5
    w = whiten(a, m)
    assert abs(w[m].mean()) < 1e-12 and abs(w[m].std() - 1) < 1e-6 and np.all(w[~m] == 0)


def _multi_turn_packed_rows(seed: int, rows: int = 4, positions: int = 96):
    """Packed rows of multi-turn episodes (prompt, sampled turns separated by environment tokens, rewards per turn),
    half of them truncated (bootstrap at their last position), with padding at each row's end."""
    rng = np.random.default_rng(seed)
    segs = np.full((rows, positions), -1, np.int32)
    rewards = np.zeros((rows, positions))
    values = rng.normal(size=(rows, positions))
    mask = np.zeros((rows, positions), bool)
    boot = np.zeros((rows, positions))
    for r in range(rows):
        start, seg = 0, 0
        while True:
            length = int(rng.integers(6, 30))
            if start + length > positions - 3:
                break
            sl = np.arange(start, start + length)
            kind = rng.integers(0, 3, length)  # 0: prompt / environment token, else sampled
            kind[:2] = 0  # every episode starts with prompt tokens
            mask[r, sl] = kind > 0
            sampled = sl[kind > 0]
            if sampled.size:
                for t in rng.choice(sampled, size=min(3, sampled.size), replace=False):
                    rewards[r, t] = rng.normal()  # a turn's reward on a sampled token
            if rng.random() < 0.5:
                boot[r, start + length - 1] = rng.normal()
            segs[r, sl] = seg
            start, seg = start + length, seg + 1
    return rewards, values, mask, segs, boot


@pytest.mark.parametrize(
    "gamma,lam,lam_between", [(1.0, 1.0, None), (0.99, 0.95, None), (1.0, 1.0, 0.0), (0.9, 0.5, 0.3)]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_gae_equals_the_numpy_reference(gamma, lam, lam_between, seed):
    """The learner's jitted GAE (reverse scan with segment resets) against `gae_packed` on multi-turn, truncated and
    packed rows, to 1e-6; whitening against `whiten`."""
    import jax
    import jax.numpy as jnp

    from marin_rl.learner.gae import gae_packed_device, whiten_device

    rewards, values, mask, segs, boot = _multi_turn_packed_rows(seed)
    # the device computes in float32: the float64 reference sees the same float32 inputs
    rewards, values, boot = (x.astype(np.float32).astype(np.float64) for x in (rewards, values, boot))
    ref_adv, ref_ret = gae_packed(rewards, values, mask, segs, gamma, lam, boot, lam_between)
    run = jax.jit(lambda r, v, m, s, b: gae_packed_device(r, v, m, s, gamma, lam, b, lam_between))
    f32 = [jnp.asarray(x, jnp.float32) for x in (rewards, values)]
    adv, ret = run(*f32, jnp.asarray(mask), jnp.asarray(segs), jnp.asarray(boot, jnp.float32))
    assert np.abs(ref_adv).max() > 0.5  # the rows carry real signal
    np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ret), ref_ret, rtol=0, atol=1e-6)
    white = jax.jit(whiten_device)(jnp.asarray(ref_adv, jnp.float32), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(white), whiten(ref_adv, mask), rtol=0, atol=1e-6)
