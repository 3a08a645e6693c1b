"""The critic of PPO: a value model with its own optimizer, its per-token values (`critic_inf`), GAE advantages and
returns for a batch, and the clipped value loss (`critic_train`).

With `learner.critic.enabled`, each train step is: the critic's values of the batch (before any update) → GAE over
the batch's per-token rewards (`marin_rl.replay.gae`, γ and λ from the config; truncated episodes bootstrap from the
value after their last token) → the policy steps on those advantages → one critic step on the returns, with PPO's
clipped value loss

    L_V = ½ · mean over sampled tokens of max((V − R)², (V_old + clip(V − V_old, −ε_V, ε_V) − R)²)

(V_old: the values the advantages were computed with). Batches must carry per-token rewards
(`replay.advantage_estimator: gae`).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp

from marin_rl.learner.config import CriticConfig
from marin_rl.learner.distributed import host_arrays
from marin_rl.learner.gae import gae_packed_device, masked_mean, masked_variance, whiten_device
from marin_rl.learner.losses import value_loss
from marin_rl.learner.step import critic_step
from marin_rl.learner.train_state import train_state_field
from marin_rl.model.build import build_model
from marin_rl.model.config import ModelConfig
from marin_rl.model.value import ValueModel, head_on, token_values, value_model_from, zero_value_head
from marin_rl.types import PackedBatch

__all__ = ["Critic", "value_loss"]


class Critic:
    """The value model, its optimizer state and its two calls: `advantages` (critic_inf, then GAE) and `train`
    (critic_train). Owned by a `Learner` (`learner.critic.enabled`), whose train state holds its arrays and whose
    `Sharding` lays out its parameters like the policy's and its batches like the policy's batches.

    `model` is what the critic trains and checkpoints: a whole `ValueModel` with a separate trunk, or with
    `trunk: policy` a `ValueModel` without trunk (only the head); `value_model()` is the model that computes values.
    `model`, `opt_state` and `steps` live in the learner's train state (`critic`, `critic_opt_state`,
    `critic_steps`)."""

    model = train_state_field("critic", lambda critic: critic.learner)
    opt_state = train_state_field("critic_opt_state", lambda critic: critic.learner)
    steps = train_state_field("critic_steps", lambda critic: critic.learner)

    def __init__(self, config: CriticConfig, model_config: ModelConfig, vocab_size: int, learner):
        self.config = config
        self.learner = learner
        """The learner whose train state holds the critic's model, optimizer state and steps."""
        self.sharding = learner.sharding
        """Where the critic's arrays and batches live (the learner's placement)."""
        self.optimizer = config.optimizer.build()
        self.shares_policy_trunk = config.trunk == "policy"
        self.from_policy = config.init_from_hf is None
        if self.from_policy:
            trunk = learner.model
        else:
            trunk = build_model(dataclasses.replace(model_config, init_from_hf=config.init_from_hf), vocab_size)
        self.steps = 0
        self._set(self._initial(trunk))
        self._values = eqx.filter_jit(self._values_impl)
        self._gae = eqx.filter_jit(self._gae_impl)
        self.compute_dtype = learner.policy_setup.compute_dtype
        """The learner's compute dtype, the critic's too (`marin_rl.model.precision`)."""
        self._train = critic_step(
            self.optimizer, config.value_clip, self.shares_policy_trunk, self.sharding.params, self.compute_dtype
        )

    def _initial(self, policy) -> ValueModel:
        if self.shares_policy_trunk:
            return ValueModel(None, zero_value_head(policy))
        return value_model_from(policy)

    def value_model(self) -> ValueModel:
        """The model that computes values: the critic's own, or its head on the policy's current trunk."""
        return head_on(self.learner.model, self.model.head) if self.shares_policy_trunk else self.model

    def _set(self, model: ValueModel) -> None:
        with self.sharding.context():
            self.model = self.sharding.params(model)
            self.opt_state = self.sharding.params(self.optimizer.init(eqx.filter(model, eqx.is_inexact_array)))

    def reset_from(self, policy) -> None:
        """Take a new copy of `policy`'s trunk (zero value head, fresh optimizer state): the critic of a policy that
        was just warm-started. No-op for a critic from a Hugging Face checkpoint or on the policy's own trunk (which
        is the warm-started one already)."""
        if self.from_policy and not self.shares_policy_trunk:
            self._set(value_model_from(policy))

    def _values_impl(self, model: ValueModel, ex):
        values, after = token_values(model, ex.input_ids, ex.position_ids, ex.segment_ids, self.compute_dtype)
        return values.array, after.array

    def values(self, ex) -> tuple[jax.Array, jax.Array]:
        """critic_inf: (values, after) of the placed example `ex`, `(rows, positions)` arrays left on the devices
        (`token_values`: V before each token, and V after each token, which at an episode's last position is its
        bootstrap value)."""
        with self.sharding.context():
            return self._values(self.value_model(), ex)

    def _gae_impl(self, ex, rewards, values, after):
        cfg = self.config
        mask = ex.loss_mask.array
        truncated = ex.truncated.array if ex.truncated is not None else jnp.zeros_like(mask)
        bootstrap = jnp.where(truncated, after, 0.0)  # read only at each episode's last position
        adv, ret = gae_packed_device(
            rewards, values, mask, ex.segment_ids.array, cfg.gamma, cfg.lam, bootstrap, cfg.lam_between_turns
        )
        raw_mean = masked_mean(adv, mask)
        if cfg.whiten_advantages:
            adv = whiten_device(adv, mask)
        var = masked_variance(ret, mask)
        explained = jnp.where(var > 0, 1.0 - masked_variance(ret - values, mask) / jnp.where(var > 0, var, 1.0), 0.0)
        metrics = {
            "critic/advantage_mean": raw_mean,
            "critic/return_mean": masked_mean(ret, mask),
            "critic/explained_variance": explained,
        }
        return adv, ret, metrics

    def gae(self, ex, values: jax.Array, after: jax.Array) -> tuple[jax.Array, jax.Array, dict[str, float]]:
        """GAE on the devices (`marin_rl.learner.gae`) over the placed example `ex`'s sampled tokens, its per-token
        rewards and the critic's `values` (truncated episodes bootstrap from `after`): (advantages, whitened when
        configured; returns) as float32 device arrays, and the `critic/...` metrics as floats."""
        with self.sharding.context():
            adv, ret, metrics = self._gae(ex, jnp.asarray(ex.rewards.array, jnp.float32), values, after)
        return adv, ret, dict(zip(metrics, map(float, host_arrays(list(metrics.values()))), strict=True))

    def advantages(self, batch: PackedBatch, ex) -> tuple[jax.Array, jax.Array, jax.Array, dict[str, float]]:
        """`values` then `gae` for a batch with per-token rewards, placed as `ex`: (advantages, returns, old values,
        metrics), device arrays. Raises ValueError for a batch without rewards."""
        if batch.rewards is None or ex.rewards is None:
            raise ValueError("learner.critic needs batches with per-token rewards: set replay.advantage_estimator: gae")
        values, after = self.values(ex)
        adv, ret, metrics = self.gae(ex, values, after)
        return adv, ret, values, metrics

    def train(self, ex, old_values: jax.Array, returns: jax.Array) -> dict[str, float]:
        """critic_train: one optimizer step of the clipped value loss on the placed example `ex`, towards `returns`
        from `old_values` (arrays over its rows and positions: the device arrays of `values` and `gae`, or host
        arrays); `critic/...` metrics (the loss at the weights before the step)."""
        axes = ex.input_ids.axes
        targets = tuple(hax.named(jnp.asarray(x, jnp.float32), axes) for x in (old_values, returns))
        targets = self.sharding.batch(targets)
        with self.sharding.context():
            self.learner.train_state, metrics = self._train(self.learner.train_state, ex, *targets)
            [metrics] = [dict(zip(metrics, host_arrays(list(metrics.values())), strict=True))]
        self.steps += 1
        out = {f"critic/{k}": float(v) for k, v in metrics.items()}
        out["critic/learning_rate"] = self.config.optimizer.lr_at(self.steps - 1)
        return out
