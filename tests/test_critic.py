"""PPO's critic: the clipped value loss against NumPy (values and gradients), the critic's advantages equal GAE
computed from its own values, a critic that learns the returns, and the learner raising what a critic needs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl.learner.batch import to_example
from marin_rl.learner.config import CriticConfig, LearnerConfig
from marin_rl.learner.critic import value_loss
from marin_rl.learner.learner import Learner
from marin_rl.learner.optimizer import OptimizerConfig
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.model.value import token_values
from marin_rl.replay.gae import gae_packed, whiten
from marin_rl.replay.packing import Sequence, pack
from marin_rl.tokenizer import build_char_tokenizer
from marin_rl.types import PackedBatch


def _np_value_loss(v, old, ret, mask, clip):
    v, old, ret = (x.astype(np.float64) for x in (v, old, ret))
    unclipped = (v - ret) ** 2
    per = unclipped if clip is None else np.maximum(unclipped, (old + np.clip(v - old, -clip, clip) - ret) ** 2)
    return 0.5 * (per * mask).sum() / mask.sum()


def _np_value_loss_grad(v, old, ret, mask, clip):
    """d/dV: (V − R)/N where the unclipped term is the larger (or no clipping), (V_clip − R)·1[|V − V_old| < ε]/N
    where the clipped one is; 0 off the mask."""
    v, old, ret = (x.astype(np.float64) for x in (v, old, ret))
    n = mask.sum()
    g = (v - ret) / n
    if clip is not None:
        vc = old + np.clip(v - old, -clip, clip)
        use_clipped = (vc - ret) ** 2 > (v - ret) ** 2
        inside = np.abs(v - old) < clip
        g = np.where(use_clipped, (vc - ret) * inside / n, g)
    return np.where(mask, g, 0.0)


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_and_its_gradient_match_numpy(clip):
    rng = np.random.default_rng(0)
    shape = (3, 16)
    v, old, ret = (rng.normal(size=shape).astype(np.float32) for _ in range(3))
    mask = rng.random(shape) < 0.6
    loss, metrics = value_loss(jnp.asarray(v), jnp.asarray(old), jnp.asarray(ret), jnp.asarray(mask), clip)
    np.testing.assert_allclose(float(loss), _np_value_loss(v, old, ret, mask, clip), rtol=1e-5)
    grad = jax.grad(lambda x: value_loss(x, jnp.asarray(old), jnp.asarray(ret), jnp.asarray(mask), clip)[0])(
        jnp.asarray(v)
    )
    np.testing.assert_allclose(np.asarray(grad), _np_value_loss_grad(v, old, ret, mask, clip), rtol=1e-5, atol=1e-7)
    if clip is not None:
        assert 0 < float(metrics["value_clip_frac"]) < 1


def _critic_learner(**critic):
    tok = build_char_tokenizer()
    cfg = LearnerConfig(
        algorithm="ppo",
        optimizer=OptimizerConfig(learning_rate=1e-3),
        critic=CriticConfig(enabled=True, **{"optimizer": OptimizerConfig(learning_rate=3e-3), **critic}),
    )
    return tok, Learner(ModelConfig(architecture=tiny_llama()), cfg, len(tok))


def _reward_batch(learner, tok, truncate: bool = False) -> PackedBatch:
    """Prompts 'a:' and 'b:' with the same completion; reward 1 after 'a:' and 0 after 'b:', at the last token;
    `truncate`: one episode of each kind was cut off (it bootstraps). Sampler logprobs are the learner's."""
    seqs = []
    for prompt, reward in (("a:", 1.0), ("b:", 0.0)):
        for k in range(4):
            s = Sequence.supervised(tok(prompt)["input_ids"], tok("xyz")["input_ids"])
            s.rewards = np.zeros(len(s), np.float32)
            s.rewards[-1] = reward
            s.episode_truncated = truncate and k == 0
            s.token_versions = np.where(s.loss_mask, 0, -1).astype(np.int32)
            seqs.append(s)
    batch, placed = pack(seqs, 4, 16)
    assert len(placed) == len(seqs) and batch.rewards is not None and batch.truncated.any() == truncate
    batch.sampler_logprobs = np.where(batch.loss_mask, learner.logprobs(batch), 0.0).astype(np.float32)
    return batch


@pytest.mark.parametrize("trunk", ["separate", "policy"])
def test_critic_advantages_are_gae_of_its_own_values_and_the_critic_learns_the_returns(trunk):
    tok, learner = _critic_learner(gamma=0.99, lam=0.9, trunk=trunk)
    batch = _reward_batch(learner, tok, truncate=True)
    ex = learner.sharding.batch(to_example(batch))
    values, after = (
        np.asarray(x.array)
        for x in token_values(learner.critic.value_model(), ex.input_ids, ex.position_ids, ex.segment_ids)
    )
    assert np.all(values == 0)  # a new critic's head is zero: the first advantages are the discounted rewards to go
    adv, ret, old, _ = learner.critic.advantages(batch, ex)
    boot = np.where(batch.truncated, after, 0.0)
    ref_adv, ref_ret = gae_packed(batch.rewards, values, batch.loss_mask, batch.segment_ids, 0.99, 0.9, boot)
    np.testing.assert_allclose(adv, whiten(ref_adv, batch.loss_mask), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-6)
    batch = _reward_batch(learner, tok)  # the same episodes, all ended: each state has one return
    losses = []
    for _ in range(40):
        metrics = learner.train_step(batch)
        losses.append(metrics["learner/critic/value_loss"])
    assert learner.version == 40 and learner.critic.steps == 40
    assert losses[-1] < 0.2 * losses[0], losses
    values, _ = (
        np.asarray(x.array)
        for x in token_values(learner.critic.value_model(), ex.input_ids, ex.position_ids, ex.segment_ids)
    )
    # V(state after the prompt) now tells the rewarded prompt from the other: ~0.99² after 'a:', ~0 after 'b:'
    first = {"a": [], "b": []}
    episodes = {(r, batch.segment_ids[r, c]) for r, c in zip(*np.nonzero(batch.segment_ids >= 0), strict=True)}
    for r, seg in episodes:
        cols = np.flatnonzero(batch.segment_ids[r] == seg)
        prompt = tok.decode(batch.input_ids[r, cols].tolist())
        first[prompt.lstrip()[0]].append(values[r, cols[batch.loss_mask[r, cols]][0]])
    assert len(first["a"]) == len(first["b"]) == 4
    assert min(first["a"]) > 0.7 and max(first["b"]) < 0.3, first


def test_policy_with_critic_raises_the_rewarded_completion():
    """GAE advantages (whitened) push up the logprob of completions after the rewarded prompt."""
    tok, learner = _critic_learner()
    batch = _reward_batch(learner, tok)
    before = learner.logprobs(batch)
    for _ in range(5):
        learner.train_step(batch)
    gain = (learner.logprobs(batch) - before) * batch.loss_mask
    rewarded = np.zeros_like(batch.loss_mask)  # tokens of the episodes after 'a:' (reward 1)
    for r, c in zip(*np.nonzero(batch.loss_mask), strict=True):
        start = np.flatnonzero(batch.segment_ids[r] == batch.segment_ids[r, c])[0]
        rewarded[r, c] = "a" in tok.decode(batch.input_ids[r, start:c].tolist())
    assert gain[rewarded].sum() > 0 > gain[batch.loss_mask & ~rewarded].sum(), gain


def test_a_critic_needs_rewards_and_rewards_need_a_critic():
    tok, learner = _critic_learner()
    batch = _reward_batch(learner, tok)
    no_rewards = PackedBatch(**{**vars(batch), "rewards": None, "truncated": None})
    with pytest.raises(ValueError, match="per-token rewards"):
        learner.train_step(no_rewards)
    plain = Learner(ModelConfig(architecture=tiny_llama()), LearnerConfig(), len(tok))
    with pytest.raises(ValueError, match="does not use them"):
        plain.train_step(batch)


@pytest.mark.parametrize("trunk", ["separate", "policy"])
def test_critic_and_its_optimizer_state_round_trip_through_a_checkpoint(tmp_path, trunk):
    """A fresh learner that loads the checkpoint continues exactly as the saved one: the next step's policy and
    critic metrics are equal, and a checkpoint with a critic does not load into a learner without one."""
    from marin_rl.checkpoint_dirs import begin_checkpoint
    from marin_rl.learner.checkpoint import load_learner_state, save_learner_state

    tok, learner = _critic_learner(trunk=trunk)
    batch = _reward_batch(learner, tok)
    for _ in range(2):
        learner.train_step(batch)
    path = begin_checkpoint(str(tmp_path), learner.version)
    save_learner_state(learner, path, learner.version)
    expected = learner.train_step(batch)
    _, resumed = _critic_learner(trunk=trunk)
    load_learner_state(resumed, path)
    assert resumed.version == 2 and resumed.critic.steps == 2
    got = resumed.train_step(batch)
    for key in ("learner/loss", "learner/critic/value_loss", "learner/critic/explained_variance", "learner/grad_norm"):
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-6, err_msg=key)
    plain = Learner(ModelConfig(architecture=tiny_llama()), LearnerConfig(), len(tok))
    with pytest.raises(ValueError, match="with a critic"):
        load_learner_state(plain, path)


def test_a_critic_on_the_policy_trunk_is_a_head_that_does_not_train_the_trunk():
    """`trunk: policy`: the critic's parameters are the value head alone; its values are that head applied to the
    policy's own last hidden states (computed here independently); a critic step changes the head and nothing of the
    policy."""
    tok, learner = _critic_learner(trunk="policy")
    critic = learner.critic
    head_params = jax.tree_util.tree_leaves(critic.model)
    assert critic.model.trunk is None and sum(x.size for x in head_params) == 128 + 1  # Embed weights and a bias
    batch = _reward_batch(learner, tok)
    ex = learner.sharding.batch(to_example(batch))
    critic.model = jax.tree_util.tree_map(
        lambda x: x + 0.01 * jnp.arange(x.size).reshape(x.shape) / x.size, critic.model
    )  # a head that is not zero
    values, after = critic.values(ex)
    from marin_rl.model.logprobs import packed_attention_mask

    hidden = learner.model.activations(
        ex.input_ids, attn_mask=packed_attention_mask(ex.segment_ids), pos_ids=ex.position_ids
    )
    h = np.asarray(hidden.rearrange(("batch", "position", "embed")).array, np.float64)
    w = np.asarray(critic.model.head.weight.rearrange(("embed", "value")).array, np.float64)[:, 0]
    expected = h @ w + float(np.asarray(critic.model.head.bias.array)[0])
    np.testing.assert_allclose(after, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(values[:, 1:], expected[:, :-1], rtol=1e-4, atol=1e-5)
    policy_before = [np.asarray(x) for x in learner.weights()]
    head_before = [np.asarray(x) for x in jax.tree_util.tree_leaves(critic.model)]
    returns = np.where(batch.loss_mask, 1.0, 0.0).astype(np.float32)
    critic.train(ex, values.astype(np.float32), returns)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(policy_before, learner.weights(), strict=True))
    assert any(
        not np.array_equal(a, np.asarray(b))
        for a, b in zip(head_before, jax.tree_util.tree_leaves(critic.model), strict=True)
    )


def test_a_critic_on_the_policy_trunk_takes_no_checkpoint_of_its_own():
    with pytest.raises(ValueError, match="separate trunk"):
        CriticConfig(enabled=True, trunk="policy", init_from_hf="/some/checkpoint")
    with pytest.raises(ValueError, match="trunk must be one of"):
        CriticConfig(enabled=True, trunk="shared")


@pytest.mark.parametrize("trunk", ["separate", "policy"])
def test_a_ppo_step_uploads_the_batch_once_and_keeps_values_and_advantages_on_the_device(trunk):
    """PPO's train step (values → GAE → whitening → policy step → critic step) copies the batch host → device once
    (`Learner.place_batch`) and nothing else: JAX's transfer guard, set to refuse every host → device copy, implicit
    or explicit, except inside that one placement, lets the whole step run (a NumPy GAE, or advantages and returns
    uploaded again, would be refused, as the last assertion shows)."""
    tok, learner = _critic_learner(gamma=0.99, lam=0.9, trunk=trunk)
    batch = _reward_batch(learner, tok, truncate=True)
    learner.train_step(batch)  # compiled outside the guard
    placed = []
    place = learner.place_batch

    def place_once(b):
        placed.append(b)
        with jax.transfer_guard_host_to_device("allow"):
            return place(b)

    learner.place_batch = place_once
    with jax.transfer_guard_host_to_device("disallow_explicit"):
        metrics = learner.train_step(batch)
    assert placed == [batch]
    assert np.isfinite(metrics["learner/critic/value_loss"]) and np.isfinite(metrics["learner/loss"])
    ex = place(batch)
    values, _ = learner.critic.values(ex)
    host_returns = np.zeros(batch.input_ids.shape, np.float32)  # a target that lives on the host
    with jax.transfer_guard_host_to_device("disallow_explicit"), pytest.raises(Exception, match="host-to-device"):
        learner.critic.train(ex, values, host_returns)
