"""The one optimizer step every trained model takes: the policy's RL and supervised steps, the critic's, the reward
model's and its language-model pretraining all apply their gradients here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import optax


def _unchanged(tree):
    return tree


def apply_gradients(
    model: Any,
    grads: Any,
    opt_state: optax.OptState,
    optimizer: optax.GradientTransformation,
    shard: Callable[[Any], Any] = _unchanged,
) -> tuple[Any, optax.OptState, jax.Array]:
    """One optimizer step: `optimizer`'s update of `model`'s inexact arrays from `grads` (laid out by `shard`, e.g.
    a learner's parameter mapping; applied to the gradients, the new model and the new state). Returns (model,
    opt_state, the gradients' global norm before any clipping). Traceable: call it inside jit."""
    grads = shard(grads)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return shard(eqx.apply_updates(model, updates)), shard(opt_state), optax.global_norm(grads)


def loss_step(
    loss_fn: Callable[[Any], tuple[jax.Array, dict[str, jax.Array]]],
    model: Any,
    opt_state: optax.OptState,
    optimizer: optax.GradientTransformation,
    shard: Callable[[Any], Any] = _unchanged,
) -> tuple[Any, optax.OptState, dict[str, jax.Array]]:
    """The gradient of `loss_fn(model) -> (loss, metrics)` and `apply_gradients`. Returns (model, opt_state,
    metrics with `loss` and `grad_norm` added; both at the weights before the step)."""
    (loss, metrics), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model)
    model, opt_state, grad_norm = apply_gradients(model, grads, opt_state, optimizer, shard)
    return model, opt_state, {**metrics, "loss": loss, "grad_norm": grad_norm}
