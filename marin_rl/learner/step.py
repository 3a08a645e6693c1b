"""The one optimizer step every trained model takes: the policy's RL and supervised steps, the critic's, the reward
model's and its language-model pretraining all apply their gradients here; and microbatching, the wrapper that
accumulates a gradient over row chunks of a batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import optax

from marin_rl.learner.losses import combine_metrics


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


def _share_of(metrics: dict[str, jax.Array], share: jax.Array) -> dict[str, jax.Array]:
    """A chunk's metrics scaled by its share of the batch (maxima and minima kept), so that `combine_metrics` adds
    the chunks up to their weighted mean."""
    return {k: v if k.rsplit("/", 1)[-1].startswith(("max", "min")) else v * share for k, v in metrics.items()}


def microbatched(
    grad_fn: Callable[[Any], tuple[Any, dict[str, jax.Array]]],
    chunks: Any,
    zeros: Any,
    shares: jax.Array | None = None,
) -> tuple[Any, dict[str, jax.Array]]:
    """Gradient accumulation: `grad_fn(chunk) -> (grads, metrics)` over the chunks stacked along the leading axis of
    every leaf of `chunks`, one chunk at a time (a `lax.scan`, so only one chunk's activations live at once),
    starting from `zeros` (zero gradients of the trained parameters).

    Without `shares` the chunks' gradients and metrics are summed: right for a loss whose every chunk is normalised by
    the whole batch, where the sum is the batch's gradient exactly. With `shares` (one weight per chunk, summing to
    1) they are the weighted mean (maxima and minima: the maximum and minimum). Returns (grads, metrics). Traceable."""

    def body(acc, xs):
        chunk, share = xs
        grads, metrics = grad_fn(chunk)
        if share is None:
            return jax.tree_util.tree_map(jax.numpy.add, acc, grads), metrics
        return jax.tree_util.tree_map(lambda a, g: a + share * g, acc, grads), _share_of(metrics, share)

    grads, stacked = jax.lax.scan(body, zeros, (chunks, shares))
    return grads, combine_metrics(stacked)
