"""The learner's steps, as pure functions of a `TrainState` and a batch.

* `apply_gradients` / `loss_step`: the one optimizer step every trained model takes (the policy's RL and supervised
  steps, the critic's, the reward model's and its language-model pretraining all apply their gradients here);
* `microbatched`: gradient accumulation over row chunks of a batch (a `lax.scan` over the batch axis);
* `policy_update`, `critic_update`, `supervised_update`: traceable `(state, batch, ...) -> (state, metrics)` of the
  policy's RL step (accumulating `microbatches` chunks), the critic's value step and the supervised step;
  `policy_step`, `critic_step`, `supervised_step` build their compiled forms (the optimizer states donated, the
  models not: a reference model or a published copy may share their arrays).

The host drivers (`Learner`, `Critic`, the warm start, SFT) place batches, call these and keep the counters (host
ints, so that a compiled step never sees them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import optax

from marin_rl.learner.batch import RlExample, from_raw, sampled_tokens
from marin_rl.learner.config import OBJECTIVES, LossConfig
from marin_rl.learner.loss_registry import LossSpec
from marin_rl.learner.losses import combine_metrics, loss_normalizers, sft_loss, value_loss
from marin_rl.learner.sharding import Sharding
from marin_rl.learner.train_state import TrainState
from marin_rl.model import lora
from marin_rl.model.logprobs import token_logprobs, token_logprobs_at
from marin_rl.model.moe import with_replayed_routing
from marin_rl.model.value import head_on, token_values


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


# ---- the policy's RL step -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class PolicySetup:
    """What a policy step is compiled for (hashed by identity: one per learner)."""

    loss_config: LossConfig
    """The run's `learner.loss`."""
    temperature: float
    """The sampling temperature the logprobs are taken at."""
    microbatches: int
    """Row chunks each optimizer step accumulates its gradient over."""
    sharding: Sharding
    """Where parameters and chunks live."""
    compute_dtype: str | None = None
    """The forward and backward passes' dtype (`model.compute_dtype` resolved for the devices, e.g. 'bfloat16'); the
    parameters, logprobs and loss stay float32. None: the parameters' own dtype."""
    routing_replay: bool = False
    """A mixture of experts routes each token by the sampler's recorded experts (`learner.moe.routing_replay`)."""

    def loss_config_for(self, loss: LossSpec) -> LossConfig:
        """The `LossConfig` a loss sees: the run's, with a built-in objective's name when `loss` is one."""
        cfg = self.loss_config
        if loss.name in OBJECTIVES and cfg.objective != loss.name:
            return dataclasses.replace(cfg, objective=loss.name)
        return cfg

    def uses_proximal(self, loss: LossSpec) -> bool:
        """Whether `loss` reads proximal logprobs."""
        return self.loss_config_for(loss).uses_proximal if loss.name in OBJECTIVES else loss.uses_proximal

    def kept_depends_on_proximal(self, loss: LossSpec) -> bool:
        """Whether which tokens `loss` keeps depends on the proximal logprobs."""
        return loss.name in OBJECTIVES and self.loss_config_for(loss).kept_depends_on_proximal

    def needs_prepare(self, loss: LossSpec, steps: int) -> bool:
        """Whether a batch of `steps` optimizer steps needs its proximal or reference logprobs before the first."""
        if steps > 1:
            return self.uses_proximal(loss) or self.loss_config.kl_coef > 0
        # Accumulating microbatches needs the kept tokens, and so the proximal logprobs, before any chunk's forward.
        return self.microbatches > 1 and self.kept_depends_on_proximal(loss)


def policy_logprobs(
    model, ex: RlExample, temperature: float, compute_dtype: str | None = None, routing_replay: bool = False
):
    """(logprobs, entropies) of every token of `ex` under `model` at `temperature`, computed in `compute_dtype`; with
    `routing_replay` a mixture of experts routes each token by `ex.routed_experts` (`replayed_routing`)."""
    args = (ex.input_ids, ex.position_ids, ex.segment_ids)
    model = replayed_routing(model, ex) if routing_replay else model
    return token_logprobs(model, *args, temperature=temperature, compute_dtype=compute_dtype)


def replayed_routing(model, ex: RlExample):
    """`model` routing each token of `ex` by the sampler's recorded experts (`marin_rl.model.moe`); ValueError when
    the batch carries none."""
    if ex.routed_experts is None:
        raise ValueError(
            "learner.moe.routing_replay: the batch carries no routed experts (the rollouts were sampled without "
            "recording them)"
        )
    return with_replayed_routing(model, ex.routed_experts)


def policy_grads(setup: PolicySetup, model, reference, ex: RlExample, normalizers, loss: LossSpec):
    """The RL loss's gradient over `model`'s trainable parameters (with LoRA the adapters) on `ex`, with the
    reference logprobs filled in from `reference` when the batch lacks them; returns (grads, metrics)."""
    if reference is not None and ex.reference_logprobs is None:
        ref_lp, _ = policy_logprobs(reference, ex, setup.temperature, setup.compute_dtype, setup.routing_replay)
        ex = dataclasses.replace(ex, reference_logprobs=jax.lax.stop_gradient(ref_lp))
    config = setup.loss_config_for(loss)
    trainable, frozen = lora.split(model)  # with LoRA only the adapters get gradients

    def loss_fn(t):
        extra = {}
        if loss.takes_student_top_logprobs:  # the student's logprobs at the teacher's top-k, same forward pass
            if ex.teacher_top_ids is None:
                raise ValueError(f"loss {loss.name!r} needs the teacher's top-k in the batch: set teacher.top_k > 0")
            args = (ex.input_ids, ex.position_ids, ex.segment_ids, ex.teacher_top_ids)
            policy = lora.join(t, frozen)
            policy = replayed_routing(policy, ex) if setup.routing_replay else policy
            lp, ent, top = token_logprobs_at(
                policy, *args, temperature=setup.temperature, compute_dtype=setup.compute_dtype
            )
            extra["student_top_logprobs"] = top
        else:
            lp, ent = policy_logprobs(
                lora.join(t, frozen), ex, setup.temperature, setup.compute_dtype, setup.routing_replay
            )
        value, metrics = loss(lp, ent, ex, config=config, normalizers=normalizers, **extra)
        return value, {**metrics, "loss": value}

    (_, metrics), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(trainable)
    return grads, metrics


def policy_update(
    setup: PolicySetup,
    state: TrainState,
    reference,
    ex: RlExample,
    optimizer: optax.GradientTransformation,
    loss: LossSpec,
    loss_weight_fn=None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step of the policy (`state.model`, `state.opt_state`, a state of `optimizer`) on `ex` (one
    minibatch), accumulating over `setup.microbatches` row chunks. Traceable.

    Chunks of a loss that takes `normalizers` (the built-ins) are normalised by the whole minibatch, so their
    gradients add up to its gradient exactly; otherwise (or when `loss_weight_fn` is given) the minibatch's gradient
    and metrics are the chunks' averaged with weights `loss_weight_fn(chunk)` (default: the chunk's number of
    sampled tokens). Returns the state with the new policy and optimizer state, and the step's metrics."""
    model = state.model
    n = setup.microbatches
    if n == 1:
        grads, metrics = policy_grads(setup, model, reference, ex, None, loss)
    else:
        zeros = jax.tree_util.tree_map(jnp.zeros_like, eqx.filter(lora.split(model)[0], eqx.is_inexact_array))
        chunks = setup.sharding.chunked(ex, n)
        if loss.takes_normalizers and loss_weight_fn is None:
            # Every chunk normalised by the whole minibatch: the chunks' gradients add up to its gradient.
            normalizers = loss_normalizers(ex, setup.loss_config_for(loss))
            shares = None
        else:
            normalizers = None
            weight_fn = loss_weight_fn or sampled_tokens
            weights = jax.lax.map(lambda raw: jnp.asarray(weight_fn(from_raw(raw)), jnp.float32), chunks)
            shares = weights / jnp.maximum(jnp.sum(weights), 1e-12)
        grads, metrics = microbatched(
            lambda raw: policy_grads(setup, model, reference, from_raw(raw), normalizers, loss), chunks, zeros, shares
        )
    trainable, frozen = lora.split(model)
    trainable, opt_state, metrics["grad_norm"] = apply_gradients(
        trainable, grads, state.opt_state, optimizer, setup.sharding.params
    )
    return state.replace(model=lora.join(trainable, frozen), opt_state=opt_state), metrics


def prepare_logprobs(setup: PolicySetup, model, reference, ex: RlExample, num_chunks: int, want_prox: bool):
    """`ex` with proximal logprobs (current weights, when `want_prox`) and/or reference logprobs filled in,
    `num_chunks` row chunks at a time. Traceable."""
    want_prox = want_prox and ex.proximal_logprobs is None
    want_ref = reference is not None and ex.reference_logprobs is None

    def forward(raw):
        chunk = from_raw(raw)
        out = {}
        if want_prox:
            lp, _ = policy_logprobs(model, chunk, setup.temperature, setup.compute_dtype, setup.routing_replay)
            out["proximal_logprobs"] = lp.array
        if want_ref:
            lp, _ = policy_logprobs(reference, chunk, setup.temperature, setup.compute_dtype, setup.routing_replay)
            out["reference_logprobs"] = lp.array
        return out

    if not (want_prox or want_ref):
        return ex
    out = jax.lax.map(forward, setup.sharding.chunked(ex, num_chunks))
    axes = ex.input_ids.axes
    filled = {k: hax.named(jax.lax.stop_gradient(v.reshape(-1, v.shape[-1])), axes) for k, v in out.items()}
    return dataclasses.replace(ex, **filled)


def policy_step(setup: PolicySetup) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
    """The compiled `policy_update`: `step(state, reference, ex, optimizer, loss, loss_weight_fn) -> (state,
    metrics)` (the counters are the host driver's: it commits them once the steps' metrics are checked). The
    optimizer state is donated; the policy is not (the reference model must survive the step, and so must the batch:
    several epochs reuse it). `optimizer`, `loss` and `loss_weight_fn` are part of the compiled step."""

    def body(inputs, opt_state, optimizer, loss, loss_weight_fn):
        model, reference, ex = inputs
        state = TrainState(model, opt_state)
        new, metrics = policy_update(setup, state, reference, ex, optimizer, loss, loss_weight_fn)
        return new.model, new.opt_state, metrics

    compiled = eqx.filter_jit(body, donate="all-except-first")

    def step(state: TrainState, reference, ex: RlExample, optimizer, loss: LossSpec, loss_weight_fn=None):
        inputs = (state.model, reference, ex)
        model, opt_state, metrics = compiled(inputs, state.opt_state, optimizer, loss, loss_weight_fn)
        return state.replace(model=model, opt_state=opt_state), metrics

    return step


# ---- the critic's step ----------------------------------------------------------------------------------------------
def critic_update(
    state: TrainState,
    ex: RlExample,
    old_values: hax.NamedArray,
    returns: hax.NamedArray,
    *,
    optimizer: optax.GradientTransformation,
    value_clip: float | None,
    shares_trunk: bool,
    shard: Callable[[Any], Any] = _unchanged,
    compute_dtype: str | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step of the critic (`state.critic`, `state.critic_opt_state`; with `shares_trunk` its head on
    `state.model`'s trunk) of PPO's clipped value loss on `ex`, towards `returns` from `old_values`, computing in
    `compute_dtype`. Traceable."""
    policy = state.model if shares_trunk else None

    def loss_fn(m):
        full = head_on(policy, m.head) if policy is not None else m
        values, _ = token_values(full, ex.input_ids, ex.position_ids, ex.segment_ids, compute_dtype)
        return value_loss(values.array, old_values.array, returns.array, ex.loss_mask.array, value_clip)

    (_, metrics), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(state.critic)
    model, opt_state, metrics["grad_norm"] = apply_gradients(
        state.critic, grads, state.critic_opt_state, optimizer, shard
    )
    return state.replace(critic=model, critic_opt_state=opt_state), metrics


def critic_step(
    optimizer: optax.GradientTransformation,
    value_clip: float | None,
    shares_trunk: bool,
    shard=_unchanged,
    compute_dtype: str | None = None,
) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
    """The compiled `critic_update`: `step(state, ex, old_values, returns) -> (state, metrics)`, the critic's
    optimizer state donated (the driver counts `critic_steps`)."""

    def body(inputs, opt_state):
        model, policy, ex, old_values, returns = inputs
        state = TrainState(policy, None, critic=model, critic_opt_state=opt_state)
        kw = dict(optimizer=optimizer, value_clip=value_clip, shares_trunk=shares_trunk, shard=shard)
        kw["compute_dtype"] = compute_dtype
        new, metrics = critic_update(state, ex, old_values, returns, **kw)
        return new.critic, new.critic_opt_state, metrics

    compiled = eqx.filter_jit(body, donate="all-except-first")

    def step(state: TrainState, ex: RlExample, old_values, returns):
        policy = state.model if shares_trunk else None
        inputs = (state.critic, policy, ex, old_values, returns)
        model, opt_state, metrics = compiled(inputs, state.critic_opt_state)
        return state.replace(critic=model, critic_opt_state=opt_state), metrics

    return step


# ---- the supervised step (the warm start, `learner.mode: sft`) ------------------------------------------------------
def supervised_update(
    state: TrainState, ex: RlExample, optimizer: optax.GradientTransformation, shard=_unchanged, compute_dtype=None
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step of the supervised loss (the mean negative log-likelihood at temperature 1 of the tokens
    where `loss_mask` is true, over the whole batch) of `state.model` (with LoRA its adapters) with
    `state.opt_state`, a state of `optimizer`, computing in `compute_dtype`. Metrics: `loss`, `grad_norm`, `tokens`.
    Traceable."""
    trainable, frozen = lora.split(state.model)  # with LoRA only the adapters are trained

    def loss_fn(t):
        lp, _ = policy_logprobs(lora.join(t, frozen), ex, 1.0, compute_dtype)
        return sft_loss(lp, ex.loss_mask), {"tokens": jnp.sum(ex.loss_mask.array)}

    trainable, opt_state, metrics = loss_step(loss_fn, trainable, state.opt_state, optimizer, shard)
    return state.replace(model=lora.join(trainable, frozen), opt_state=opt_state), metrics


def supervised_step(
    shard: Callable[[Any], Any] = _unchanged, compute_dtype: str | None = None
) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
    """The compiled `supervised_update`: `step(state, ex, optimizer) -> (state, metrics)` (`optimizer` must stay the
    same object between steps: it is part of the compiled step). The optimizer state is donated; the policy is not
    (the reference model or a published copy may share it). Counters are left alone (a supervised step makes no
    version)."""

    def body(inputs, opt_state, optimizer):
        model, ex = inputs
        new, metrics = supervised_update(TrainState(model, opt_state), ex, optimizer, shard, compute_dtype)
        return new.model, new.opt_state, metrics

    compiled = eqx.filter_jit(body, donate="all-except-first")

    def step(state: TrainState, ex: RlExample, optimizer: optax.GradientTransformation):
        model, opt_state, metrics = compiled((state.model, ex), state.opt_state, optimizer)
        return state.replace(model=model, opt_state=opt_state), metrics

    return step


def supervised_nll(model, ex: RlExample, compute_dtype: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Sum of the negative log-likelihoods (temperature 1) of `ex`'s loss-masked tokens under `model` (computed in
    `compute_dtype`), and their number. Traceable."""
    lp, _ = policy_logprobs(model, ex, 1.0, compute_dtype)
    mask = ex.loss_mask.array
    return -jnp.sum(jnp.where(mask, lp.array, 0.0)), jnp.sum(mask)
