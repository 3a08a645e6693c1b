"""The learner: a Levanter model trained with the clipped policy-gradient loss on packed batches."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import tempfile
import threading
import time

import equinox as eqx
import fsspec
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from marin_rl.learner import warm_start_cache
from marin_rl.learner.algorithm import get_algorithm
from marin_rl.learner.batch import TEACHER_TOP_K, RlExample
from marin_rl.learner.config import OBJECTIVES, LearnerConfig, LossConfig, check_platform, routes_experts
from marin_rl.learner.critic import Critic
from marin_rl.learner.distributed import host_arrays, is_primary
from marin_rl.learner.loss_registry import LossSpec, get_loss
from marin_rl.learner.losses import combine_metrics, loss_normalizers, sft_loss
from marin_rl.learner.step import apply_gradients, loss_step, microbatched
from marin_rl.learner.train_state import TrainState, train_state_field
from marin_rl.model import lora
from marin_rl.model.build import build_model, parameter_count
from marin_rl.model.config import ModelConfig
from marin_rl.model.hf import export_hf_checkpoint
from marin_rl.model.logprobs import token_logprobs, token_logprobs_at
from marin_rl.progress import StepProgress
from marin_rl.replay.packing import Sequence, pack
from marin_rl.types import PackedBatch

logger = logging.getLogger(__name__)


class NonFiniteTrainingError(FloatingPointError):
    """A train step gave a non-finite loss or gradient norm: the weights are no longer trustworthy, so the run
    stops at that step (the error names it and the quantity) instead of training on."""


FINITE_METRICS = ("learner/loss", "learner/grad_norm")
"""The per-optimizer-step metrics that must be finite (the gradient norm is taken before clipping, so it also
catches non-finite parameters)."""


def check_finite_steps(step_metrics: list[dict[str, float]], version: int, first_optimizer_step: int) -> None:
    """Raise `NonFiniteTrainingError` naming the learner step (the version it was making), the optimizer step and
    the quantity when one of `FINITE_METRICS` of an optimizer step is NaN or infinite."""
    for i, metrics in enumerate(step_metrics):
        for key in FINITE_METRICS:
            value = metrics.get(key)
            if value is not None and not math.isfinite(value):
                raise NonFiniteTrainingError(
                    f"learner step {version} (optimizer step {first_optimizer_step + i}): {key.split('/', 1)[1]} is "
                    f"{value}; stopping the run (check learner.optimizer.learning_rate, the rewards and the loss)"
                )


def _has_pinned_host(sharding) -> bool:
    """Whether `sharding`'s devices have pinned host memory (accelerators; a CPU device has only its own)."""
    try:
        return all(
            any(m.kind == "pinned_host" for m in d.addressable_memories()) and d.platform != "cpu"
            for d in sharding.device_set
        )
    except (AttributeError, NotImplementedError, RuntimeError):
        return False


def _to_example(batch: PackedBatch) -> RlExample:
    Batch = hax.Axis("batch", batch.num_rows)
    Pos = hax.Axis("position", batch.seq_len)
    return RlExample.from_packed(batch, Batch, Pos)


_FIELDS = [f.name for f in dataclasses.fields(RlExample)]


def _raw_fields(ex: RlExample) -> dict[str, jax.Array]:
    """The example's present fields as raw `(batch, position)` arrays (`(batch, position, k)` for the teacher's
    top-k)."""
    out = {}
    for k in _FIELDS:
        field = getattr(ex, k)
        if field is not None:
            top = (TEACHER_TOP_K,) if any(a.name == TEACHER_TOP_K for a in field.axes) else ()
            out[k] = field.rearrange(("batch", "position", *top)).array
    return out


def _from_raw(raw: dict[str, jax.Array]) -> RlExample:
    rows, seq = raw["input_ids"].shape
    axes = (hax.Axis("batch", rows), hax.Axis("position", seq))

    def named(v):
        return hax.named(v, axes if v.ndim == 2 else (*axes, hax.Axis(TEACHER_TOP_K, v.shape[2])))

    return RlExample(**{k: named(v) for k, v in raw.items()})


def _chunked(ex: RlExample, n: int) -> dict[str, jax.Array]:
    """Raw fields with the rows split into `n` consecutive chunks: arrays of shape `(n, rows / n, position, ...)`."""
    return {k: v.reshape(n, v.shape[0] // n, *v.shape[1:]) for k, v in _raw_fields(ex).items()}


def _rows(ex: RlExample, start: int, stop: int) -> RlExample:
    """Rows `[start, stop)` of an example."""
    return _from_raw({k: v[start:stop] for k, v in _raw_fields(ex).items()})


def _sampled_tokens(ex: RlExample) -> jax.Array:
    """Default weight of a microbatch chunk: its number of sampled (loss-masked) tokens."""
    return jnp.sum(ex.loss_mask.array.astype(jnp.float32))


class Learner:
    """Holds the train state (`TrainState`: the policy, its optimizer state, the counters, the reference model and
    the critic); each `train_step` consumes one batch and makes one new version.

    A batch is `minibatches × epochs` optimizer steps (one by default), each accumulating the gradients of
    `microbatches` row chunks. With `loss.kl_coef > 0` the learner also holds a frozen reference model, a copy of the
    policy taken by `freeze_reference` (at the end of the warm start, or before the first train step); with
    kl_coef = 0 no reference model exists.
    """

    model = train_state_field("model")
    opt_state = train_state_field("opt_state")
    reference_model = train_state_field("reference_model")
    version = train_state_field("version")
    optimizer_steps = train_state_field("optimizer_steps")

    def __init__(self, model_config: ModelConfig, config: LearnerConfig, vocab_size: int, temperature: float = 1.0):
        check_platform(config.platform)
        self.train_state = TrainState(model=None, opt_state=None)
        """Everything training changes; `model`, `opt_state`, `reference_model`, `version` and `optimizer_steps` are
        its fields (and `critic`'s model, optimizer state and steps)."""
        self.config = config
        self.model_config = model_config
        self.temperature = float(temperature)
        self.mesh = config.mesh.build(single=routes_experts(model_config.architecture))
        """The device mesh, or None on a single device (no sharding at all) unless the model routes experts
        (Levanter's mixture-of-experts layers route tokens in a shard_map, which needs a mesh)."""
        self.model = build_model(model_config, vocab_size)
        self.num_params = parameter_count(self.model)
        self.optimizer = config.optimizer.build()
        with self._sharding():
            self.model = self._shard_params(self.model)
        self.opt_state = None if config.lora.enabled else self.supervised_optimizer_state(self.optimizer)
        self._publish_full = True  # with LoRA, the next publish carries the base (see `publish_params`)
        self.algorithm = get_algorithm(config.algorithm)
        """The algorithm whose learner-side calls `train_step` runs (`learner.algorithm`)."""
        self.learner_calls = self.algorithm.learner_calls()
        self.reads_token_rewards = any("token_rewards" in c.reads for c in self.learner_calls)
        has_critic = "critic" in self.algorithm.roles
        self.critic = Critic(config.critic, model_config, vocab_size, self) if has_critic else None
        """The value model (an algorithm with a critic role, e.g. 'ppo'), or None."""
        self.loss = get_loss(config.loss.objective)
        """The configured loss (`loss.objective`, looked up in the loss registry); `train_step` may be given another."""
        self._offloaded: tuple | None = None  # (treedef, shardings) while the optimizer state is in host memory
        self.step_metrics: list[dict[str, float]] = []
        """Metrics of each optimizer step of the last `train_step`."""
        self.interrupted = threading.Event()
        """Set from another thread to end a warm start in progress after its current step (it raises
        KeyboardInterrupt): a run stopped during a long warm start stops within a step, not at its end."""
        # Only the optimizer state is donated: the reference model must survive the step, and so must the batch
        # (several epochs reuse it).
        self._train_step = eqx.filter_jit(self._train_step_impl, donate="all-except-first")
        self._prepare = eqx.filter_jit(self._prepare_impl)
        self._logprobs = eqx.filter_jit(self._logprobs_impl)
        logger.debug("learner: %s parameters", f"{self.num_params:,}")  # the driver and the programs say it
        if self.mesh is not None:
            logger.info("learner: mesh %s over %s devices", dict(self.mesh.shape), self.mesh.devices.size)

    # ---- LoRA -------------------------------------------------------------------------------------------
    def add_adapters(self) -> bool:
        """With `learner.lora`, wrap the policy's linear layers in adapters (once: the policy as it is becomes the
        frozen base) and start the RL optimizer over the adapters alone; False when there is nothing to do."""
        if not self.config.lora.enabled or lora.has_adapters(self.model):
            return False
        with self._sharding():
            adapted = lora.add_adapters(self.model, self.config.lora)
            if self.config.lora.init_from_peft:
                adapted = lora.load_peft(adapted, self.config.lora, self.config.lora.init_from_peft)
                logger.info("learner: LoRA adapters from %s", self.config.lora.init_from_peft)
            self.model = self._shard_params(adapted)
        self.opt_state = self.supervised_optimizer_state(self.optimizer)
        self._offloaded = None
        sizes = lora.lora_bytes(self.model)
        logger.info(
            "learner: LoRA rank %d adapters, %s parameters (%.2f%% of the base's %s)",
            self.config.lora.rank,
            f"{sizes['adapters'] // 4:,}",
            100 * sizes["adapters"] / max(sizes["base"], 1),
            f"{sizes['base'] // 4:,}",
        )
        return True

    def request_full_publish(self) -> None:
        """With LoRA: the next `publish_params` carries the base as well as the adapters (a server was replaced and
        knows no base)."""
        self._publish_full = True

    def publish_params(self):
        """What a version carries to the servers: the policy, or with LoRA the adapters' arrays, preceded by the
        base's on the first publish and after `request_full_publish` (`marin_rl.model.lora`)."""
        if not lora.has_adapters(self.model):
            return self.model
        full, self._publish_full = self._publish_full, False
        return lora.publish_leaves(self.model, full)

    def served_model(self):
        """The policy as servers run it: with LoRA, the adapters merged into the base (on the devices)."""
        with self._sharding():
            return lora.merged(self.model)

    def _reference(self):
        """The KL reference: the frozen copy, or with LoRA the base itself (adapters off; no copy)."""
        if self.config.loss.kl_coef > 0 and lora.has_adapters(self.model):
            return lora.without_adapters(self.model)
        return self.reference_model

    # ---- sharding ----------------------------------------------------------------------------------------
    def _sharding(self) -> contextlib.AbstractContextManager:
        """Context in which arrays are placed and steps traced and run: the mesh and the compute axis mapping."""
        if self.mesh is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(hax.partitioning.set_mesh(self.mesh))
        stack.enter_context(hax.axis_mapping(self.config.mesh.compute_axis_mapping))
        return stack

    @property
    def batch_shards(self) -> int:
        """Number of pieces the batch rows split into (the product of the mesh axes that `batch` maps to)."""
        if self.mesh is None:
            return 1
        target = self.config.mesh.compute_axis_mapping.get("batch", ())
        return math.prod(self.mesh.shape[a] for a in ((target,) if isinstance(target, str) else target))

    def _shard_params(self, tree):
        """Parameters or optimizer state laid out by the parameter mapping (inside jit: a sharding constraint)."""
        return tree if self.mesh is None else hax.shard(tree, self.config.mesh.param_axis_mapping, self.mesh)

    def _shard_batch(self, ex: RlExample) -> RlExample:
        """Batch rows split over the axes that `batch` maps to (outside jit: placed on the devices)."""
        return ex if self.mesh is None else hax.shard(ex, self.config.mesh.compute_axis_mapping, self.mesh)

    def place_batch(self, batch: PackedBatch) -> RlExample:
        """The host batch as an example on the learner's devices (rows split over the mesh): the one host → device
        copy of a batch. Every step of a train step reads this example; nothing uploads the batch again."""
        return self._shard_batch(_to_example(batch))

    def _chunked(self, ex: RlExample, n: int) -> dict[str, jax.Array]:
        """`_chunked`, with each chunk's rows (not the chunks) split over the devices."""
        raw = _chunked(ex, n)
        if self.mesh is None or n == 1:
            return raw
        target = self.config.mesh.compute_axis_mapping.get("batch")
        sharding = NamedSharding(self.mesh, PartitionSpec(None, target, None))
        return {k: jax.lax.with_sharding_constraint(v, sharding) for k, v in raw.items()}

    def _check_rows(self, rows: int, what: str, parts: int = 1) -> None:
        if rows % (parts * self.batch_shards) != 0:
            raise ValueError(
                f"{what}: {rows} rows do not split over the learner mesh's batch shards ({self.batch_shards} = "
                f"{self.config.mesh.compute_axis_mapping.get('batch')} of mesh {dict(self.mesh.shape)})"
                + (f" × {parts} minibatch/microbatch parts" if parts > 1 else "")
                + f"; choose a row count divisible by {parts * self.batch_shards}"
            )

    # ---- reference model -------------------------------------------------------------------------------
    def freeze_reference(self) -> bool:
        """Copy the current policy as the frozen reference of the KL penalty; no-op (False) when kl_coef = 0."""
        if self.config.loss.kl_coef <= 0:
            return False
        if self.config.lora.enabled:
            logger.info("learner: the KL reference is the LoRA base (the policy with its adapters off)")
            return True
        self.reference_model = jax.tree_util.tree_map(
            lambda x: jnp.copy(x) if eqx.is_array(x) else x, self.model, is_leaf=eqx.is_array
        )
        logger.info("learner: froze the reference model at policy version %d", self.version)
        return True

    # ---- RL ----------------------------------------------------------------------------------------
    def _token_logprobs(self, model, ex: RlExample):
        return token_logprobs(model, ex.input_ids, ex.position_ids, ex.segment_ids, temperature=self.temperature)

    def _loss_config(self, loss: LossSpec) -> LossConfig:
        """The `LossConfig` a loss sees: the run's, with a built-in objective's name when `loss` is one."""
        cfg = self.config.loss
        if loss.name in OBJECTIVES and cfg.objective != loss.name:
            return dataclasses.replace(cfg, objective=loss.name)
        return cfg

    def _uses_proximal(self, loss: LossSpec) -> bool:
        return self._loss_config(loss).uses_proximal if loss.name in OBJECTIVES else loss.uses_proximal

    def _kept_depends_on_proximal(self, loss: LossSpec) -> bool:
        return loss.name in OBJECTIVES and self._loss_config(loss).kept_depends_on_proximal

    def _grads(self, model, reference, ex: RlExample, normalizers, loss: LossSpec):
        if reference is not None and ex.reference_logprobs is None:
            ref_lp, _ = self._token_logprobs(reference, ex)
            ex = dataclasses.replace(ex, reference_logprobs=jax.lax.stop_gradient(ref_lp))
        config = self._loss_config(loss)
        trainable, frozen = lora.split(model)  # with LoRA only the adapters get gradients

        def loss_fn(t):
            extra = {}
            if loss.takes_student_top_logprobs:  # the student's logprobs at the teacher's top-k, same forward pass
                if ex.teacher_top_ids is None:
                    raise ValueError(
                        f"loss {loss.name!r} needs the teacher's top-k in the batch: set teacher.top_k > 0"
                    )
                args = (ex.input_ids, ex.position_ids, ex.segment_ids, ex.teacher_top_ids)
                lp, ent, top = token_logprobs_at(lora.join(t, frozen), *args, temperature=self.temperature)
                extra["student_top_logprobs"] = top
            else:
                lp, ent = self._token_logprobs(lora.join(t, frozen), ex)
            value, metrics = loss(lp, ent, ex, config=config, normalizers=normalizers, **extra)
            return value, {**metrics, "loss": value}

        (_, metrics), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(trainable)
        return grads, metrics

    def _train_step_impl(self, inputs, opt_state, loss: LossSpec, loss_weight_fn):
        """One optimizer step on `ex` (one minibatch), accumulating over `microbatches` row chunks.

        `inputs` is (policy, reference or None, example). Chunks of a loss that takes `normalizers` (the built-ins)
        are normalised by the whole minibatch, so their gradients add up to its gradient exactly; otherwise (or when
        `loss_weight_fn` is given) the minibatch's gradient and metrics are the chunks' averaged with weights
        `loss_weight_fn(chunk)` (default: the chunk's number of sampled tokens)."""
        model, reference, ex = inputs
        n = self.config.microbatches
        if n == 1:
            grads, metrics = self._grads(model, reference, ex, None, loss)
        else:
            zeros = jax.tree_util.tree_map(jnp.zeros_like, eqx.filter(lora.split(model)[0], eqx.is_inexact_array))
            chunks = self._chunked(ex, n)
            if loss.takes_normalizers and loss_weight_fn is None:
                # Every chunk normalised by the whole minibatch: the chunks' gradients add up to its gradient.
                normalizers = loss_normalizers(ex, self._loss_config(loss))
                shares = None
            else:
                normalizers = None
                weight_fn = loss_weight_fn or _sampled_tokens
                weights = jax.lax.map(lambda raw: jnp.asarray(weight_fn(_from_raw(raw)), jnp.float32), chunks)
                shares = weights / jnp.maximum(jnp.sum(weights), 1e-12)
            grads, metrics = microbatched(
                lambda raw: self._grads(model, reference, _from_raw(raw), normalizers, loss), chunks, zeros, shares
            )
        trainable, frozen = lora.split(model)
        trainable, opt_state, metrics["grad_norm"] = apply_gradients(
            trainable, grads, opt_state, self.optimizer, self._shard_params
        )
        return lora.join(trainable, frozen), opt_state, metrics

    def _prepare_impl(self, model, reference, ex: RlExample, num_chunks: int, want_prox: bool):
        """Fill in proximal logprobs (current weights, when `want_prox`) and/or reference logprobs, `num_chunks` rows
        chunks at a time."""
        want_prox = want_prox and ex.proximal_logprobs is None
        want_ref = reference is not None and ex.reference_logprobs is None

        def forward(raw):
            chunk = _from_raw(raw)
            out = {}
            if want_prox:
                out["proximal_logprobs"] = self._token_logprobs(model, chunk)[0].array
            if want_ref:
                out["reference_logprobs"] = self._token_logprobs(reference, chunk)[0].array
            return out

        if not (want_prox or want_ref):
            return ex
        out = jax.lax.map(forward, self._chunked(ex, num_chunks))
        axes = ex.input_ids.axes
        filled = {k: hax.named(jax.lax.stop_gradient(v.reshape(-1, v.shape[-1])), axes) for k, v in out.items()}
        return dataclasses.replace(ex, **filled)

    def _needs_prepare(self, loss: LossSpec) -> bool:
        cfg = self.config
        if cfg.minibatches * cfg.epochs > 1:
            return self._uses_proximal(loss) or cfg.loss.kl_coef > 0
        # Accumulating microbatches needs the kept tokens, and so the proximal logprobs, before any chunk's forward.
        return cfg.microbatches > 1 and self._kept_depends_on_proximal(loss)

    def train_step(self, batch: PackedBatch, loss=None, loss_weight_fn=None) -> dict[str, float]:
        """Train on a packed batch (`minibatches × epochs` optimizer steps); increments the policy version by one.

        `loss`: a registered loss's name, a loss function or a `LossSpec` (default: the configured `loss.objective`);
        `loss_weight_fn(chunk) -> scalar` weighs the microbatch chunks of an optimizer step when their gradients are
        accumulated (see `_train_step_impl`). Both must be pure JAX functions (they are traced into the step).
        Returns `learner/...` metrics: those of the optimizer steps combined (mean; max of maxima, min of minima),
        `learner/optimizer_steps` (cumulative), the learning rate of the last step, timing and throughput.
        """
        loss = self.loss if loss is None else get_loss(loss)
        start = time.time()
        cfg = self.config
        m, e, n = cfg.minibatches, cfg.epochs, cfg.microbatches
        if batch.num_rows % (m * n) != 0:
            raise ValueError(
                f"the batch's {batch.num_rows} rows do not split into learner.minibatches={m} × "
                f"learner.microbatches={n} equal parts; choose a row count divisible by {m * n}"
            )
        if self.mesh is not None:
            self._check_rows(batch.num_rows, "the batch", m * n)
        if batch.rewards is None and self.reads_token_rewards:
            raise ValueError(
                f"algorithm {self.algorithm.name!r} needs batches with per-token rewards: set "
                "replay.advantage_estimator: gae"
            )
        if batch.rewards is not None and not self.reads_token_rewards:
            raise ValueError(
                f"the batch carries per-token rewards (replay.advantage_estimator: gae) but algorithm "
                f"{self.algorithm.name!r} does not use them: its group advantages are all 0 (choose an "
                "algorithm that does, e.g. learner.algorithm: ppo)"
            )
        placed = self.place_batch(batch)
        self.add_adapters()
        self.restore_optimizer()
        # the algorithm's learner side, a plain function (`Algorithm.train_step`: e.g. PPO's values, GAE, actor, critic)
        metrics = self.algorithm.train_step(self, batch, placed, loss=loss, loss_weight_fn=loss_weight_fn)
        if self.config.offload_optimizer:
            self.offload_optimizer()
        self.version += 1
        elapsed = time.time() - start
        metrics["learner/step_time_s"] = elapsed
        metrics["learner/tokens_per_s"] = e * float(np.sum(batch.segment_ids >= 0)) / max(elapsed, 1e-9)
        return metrics

    def actor_train(
        self, batch: PackedBatch, placed: RlExample, loss=None, loss_weight_fn=None, advantages=None
    ) -> dict[str, float]:
        """The policy's `minibatches × epochs` optimizer steps on a batch (`batch` on the host, `placed` on the
        devices by `place_batch`): the actor step of every algorithm. `advantages` (rows × positions, device or host)
        replaces the batch's own, e.g. a critic's GAE; `loss` and `loss_weight_fn` as in `train_step`. Returns the
        `learner/...` metrics of the steps combined, the trained tokens, the cumulative optimizer steps and the
        learning rate."""
        cfg = self.config
        m, e = cfg.minibatches, cfg.epochs
        loss = self.loss if loss is None else get_loss(loss)
        ex = placed
        if advantages is not None:
            if not isinstance(advantages, hax.NamedArray):
                advantages = hax.named(jnp.asarray(advantages, jnp.float32), ex.advantages.axes)
            ex = self._shard_batch(dataclasses.replace(ex, advantages=advantages))
        with self._sharding():
            device_metrics = self._run_steps(ex, loss, loss_weight_fn)
        self.step_metrics = [{f"learner/{k}": float(v) for k, v in s.items()} for s in jax.device_get(device_metrics)]
        check_finite_steps(self.step_metrics, self.version + 1, self.optimizer_steps + 1)
        stacked = {k: np.asarray([x[k] for x in self.step_metrics]) for k in self.step_metrics[0]}
        out = {k: float(v) for k, v in combine_metrics(stacked, rest="mean").items()}
        out["learner/trained_tokens"] = float(np.sum(batch.loss_mask))  # the batch's, not a minibatch's
        self.optimizer_steps += m * e
        out["learner/optimizer_steps"] = float(self.optimizer_steps)
        out["learner/learning_rate"] = cfg.optimizer.lr_at(self.optimizer_steps - 1)
        return out

    def _run_steps(self, ex: RlExample, loss: LossSpec, loss_weight_fn) -> list[dict[str, jax.Array]]:
        """The optimizer steps of the placed batch `ex`; their metrics, still on the devices."""
        cfg = self.config
        m, e, n = cfg.minibatches, cfg.epochs, cfg.microbatches
        if cfg.loss.kl_coef > 0 and self._reference() is None:
            self.freeze_reference()
        if self._needs_prepare(loss):
            ex = self._prepare(self.model, self._reference(), ex, m * n, self._uses_proximal(loss))
        rows = ex.input_ids.axis_size("batch") // m
        # The batch's first step runs at the proximal weights: it takes logp_prox = stop_gradient(logp) from its own
        # forward pass (ratio exactly 1), unless accumulating microbatches needs the kept tokens beforehand.
        in_step_first = not (n > 1 and self._kept_depends_on_proximal(loss))
        device_metrics = []
        for epoch in range(e):
            for i in range(m):
                sub = ex if m == 1 else self._shard_batch(_rows(ex, i * rows, (i + 1) * rows))
                if epoch == 0 and i == 0 and in_step_first and sub.proximal_logprobs is not None:
                    sub = dataclasses.replace(sub, proximal_logprobs=None)
                inputs = (self.model, self._reference(), sub)
                self.model, self.opt_state, metrics = self._train_step(inputs, self.opt_state, loss, loss_weight_fn)
                device_metrics.append(metrics)
        return device_metrics

    # ---- optimizer state in host memory -----------------------------------------------------------------
    def offload_optimizer(self) -> None:
        """Move the optimizer state to host memory (pinned host memory where the devices have it, else host arrays);
        `restore_optimizer` (which `train_step` calls) puts it back with its shardings. No-op when offloaded."""
        if self._offloaded is not None:
            return
        leaves, treedef = jax.tree_util.tree_flatten(self.opt_state)
        shardings = [x.sharding if isinstance(x, jax.Array) else None for x in leaves]
        host = []
        for x, sharding in zip(leaves, shardings, strict=True):
            if sharding is None:
                host.append(x)
            elif _has_pinned_host(sharding):
                host.append(jax.device_put(x, sharding.with_memory_kind("pinned_host")))
            else:
                host.append(np.asarray(x))
        jax.block_until_ready([h for h in host if isinstance(h, jax.Array)])
        self._offloaded = (treedef, shardings)
        self.opt_state = jax.tree_util.tree_unflatten(treedef, host)

    def restore_optimizer(self) -> None:
        """Bring an offloaded optimizer state back to the devices, each array with its sharding (no-op otherwise)."""
        if self._offloaded is None:
            return
        treedef, shardings = self._offloaded
        leaves = jax.tree_util.tree_leaves(self.opt_state)
        back = [x if s is None else jax.device_put(x, s) for x, s in zip(leaves, shardings, strict=True)]
        self.opt_state = jax.tree_util.tree_unflatten(treedef, back)
        self._offloaded = None

    # ---- evaluation helpers ----------------------------------------------------------------------------
    def _logprobs_impl(self, model, ex: RlExample):
        lp, _ = token_logprobs(model, ex.input_ids, ex.position_ids, ex.segment_ids, temperature=self.temperature)
        return lp.array

    def logprobs(self, batch: PackedBatch) -> np.ndarray:
        """Learner's logprob of every token of a packed batch under the current weights (on every process of a
        multi-host learner: all must call it)."""
        if self.mesh is None:
            return np.asarray(self._logprobs(self.model, _to_example(batch)))
        rows = batch.num_rows
        pad = -rows % self.batch_shards  # pad the rows to split evenly over the mesh; the padding is dropped
        if pad:
            batch = PackedBatch(
                **{k: None if v is None else np.concatenate([v, v[:1].repeat(pad, 0)]) for k, v in vars(batch).items()}
            )
        with self._sharding():
            [lp] = host_arrays([self._logprobs(self.model, self.place_batch(batch))])
        return lp[:rows]

    def weights(self) -> list[np.ndarray]:
        """Current parameters as host arrays, flattened like `eqx.filter(model, eqx.is_array)` (a multi-host learner
        gathers them: every process must call it)."""
        params = self.publish_params()
        return host_arrays(params if isinstance(params, list) else lora.array_leaves(params))

    def export_hf(self, path: str, tokenizer) -> str:
        """Save the current policy and `tokenizer` as a Hugging Face checkpoint at `path` (local or fsspec URL).

        A multi-host learner gathers the policy on every process (each must call this), but only process 0 writes
        `path`: Levanter's converter writes every file on every process, and two processes writing one directory
        race (one read the other's half-written tokenizer_config.json). The others write to a scratch directory
        that is removed.

        With LoRA, `path` holds the merged policy (loadable as any checkpoint), `path/peft` the adapters in PEFT's
        format and `path/base` the base they apply to (unless the base is `model.init_from_hf`, unchanged by a warm
        start: then the adapters name that)."""
        with self._sharding():  # a sharded policy is gathered under its own mesh
            with contextlib.ExitStack() as stack:
                root = path
                if not is_primary():
                    root = stack.enter_context(tempfile.TemporaryDirectory(prefix="marin_rl_hf_scratch_"))
                export_hf_checkpoint(lora.merged(self.model), tokenizer, root)
                if lora.has_adapters(self.model):
                    self._export_peft(root, tokenizer)
            return path

    def _export_peft(self, root: str, tokenizer) -> None:
        """The adapters at `root/peft` (PEFT's format), naming their base: `model.init_from_hf` when the warm start
        left it unchanged, else `root/base`, written here."""
        base = self.model_config.init_from_hf
        if base is None or self.config.warm_start.steps > 0:
            base = export_hf_checkpoint(lora.without_adapters(self.model), tokenizer, f"{root}/base")
        with tempfile.TemporaryDirectory(prefix="marin_rl_peft_") as local:
            lora.save_peft(self.model, self.config.lora, local, base, tokenizer)
            fs, target = fsspec.core.url_to_fs(f"{root}/peft")
            fs.put(f"{local}/", target, recursive=True)

    # ---- checkpoint state ------------------------------------------------------------------------------
    def state(self) -> TrainState:
        """Everything a resumed run needs from the learner: the train state with its counters as int32 arrays
        (replicated over the mesh), the optimizer state on the devices."""
        self.restore_optimizer()  # a checkpoint holds device arrays with their shardings
        self.add_adapters()  # with LoRA, a checkpoint always holds the adapted policy and the adapters' optimizer
        return self.train_state.with_counters(self._replicated)

    def _replicated(self, value: int) -> jax.Array:
        """An int32 scalar; on a mesh, replicated over all of it (a multi-host checkpoint writes only arrays that
        span the processes)."""
        if self.mesh is None:
            return jnp.asarray(value, dtype=jnp.int32)
        host = np.asarray(value, dtype=np.int32)
        return jax.make_array_from_callback((), NamedSharding(self.mesh, PartitionSpec()), lambda _: host)

    def state_template(self, has_reference: bool) -> TrainState:
        """A state shaped like `state()` (the current arrays as exemplars) for loading a checkpoint into; with
        `has_reference` it has a reference-model slot even if this learner has not frozen one yet."""
        template = self.state()
        if not has_reference:
            return template.replace(reference_model=None)
        return template if template.has_reference else template.replace(reference_model=self.model)

    def load_state(self, state: TrainState) -> None:
        """Continue from a `state()` (e.g. loaded from a checkpoint): arrays are laid out by the parameter mapping."""
        with self._sharding():
            shard = self._shard_params
            loaded = state.with_counters(int)
            self.train_state = loaded.replace(
                model=shard(state.model),
                opt_state=shard(state.opt_state),
                reference_model=None if state.reference_model is None else shard(state.reference_model),
                critic=None if self.critic is None else shard(state.critic),
                critic_opt_state=None if self.critic is None else shard(state.critic_opt_state),
            )
        self._offloaded = None
        self._publish_full = True

    # ---- supervised training: the warm start and `learner.mode: sft` ---------------------------------------
    def supervised_optimizer_state(self, optimizer: optax.GradientTransformation) -> optax.OptState:
        """A fresh state of `optimizer` (the supervised steps', or the RL one's) for the trainable parameters (the
        adapters with LoRA), laid out like them on the mesh."""
        with self._sharding():
            trainable, _ = lora.split(self.model)
            return self._shard_params(optimizer.init(eqx.filter(trainable, eqx.is_inexact_array)))

    def supervised_step(
        self, batch: PackedBatch, optimizer: optax.GradientTransformation, opt_state: optax.OptState
    ) -> tuple[optax.OptState, dict[str, jax.Array]]:
        """One optimizer step of the supervised loss on a packed batch: the mean negative log-likelihood (temperature
        1) of the tokens where `loss_mask` is true, over the whole batch. Updates the policy but not its version.

        `optimizer` must stay the same object between steps (it is part of the compiled step). Returns the new
        optimizer state and, still on the devices, `loss`, `grad_norm` and `tokens` (the number of trained tokens).
        """
        self._check_rows(batch.num_rows, "the supervised batch")
        with self._sharding():
            self.model, opt_state, metrics = self._supervised_step(
                (self.model, self.place_batch(batch)), opt_state, optimizer
            )
        return opt_state, metrics

    def supervised_nll(self, batch: PackedBatch) -> tuple[float, int]:
        """Sum of the negative log-likelihoods (temperature 1) of the batch's loss-masked tokens under the current
        weights, and their number."""
        self._check_rows(batch.num_rows, "the supervised batch")
        with self._sharding():
            total, count = self._supervised_nll(self.model, self.place_batch(batch))
        return float(total), int(count)

    @functools.cached_property
    def _supervised_step(self):
        # The optimizer state is donated; the policy is not (the reference model or a published copy may share it).
        return eqx.filter_jit(self._supervised_step_impl, donate="all-except-first")

    @functools.cached_property
    def _supervised_nll(self):
        return eqx.filter_jit(self._supervised_nll_impl)

    def _supervised_step_impl(self, inputs, opt_state, optimizer):  # inputs: (policy, example)
        model, ex = inputs
        trainable, frozen = lora.split(model)  # with LoRA only the adapters are trained

        def loss_fn(t):
            m = lora.join(t, frozen)
            lp, _ = token_logprobs(m, ex.input_ids, ex.position_ids, ex.segment_ids, temperature=1.0)
            return sft_loss(lp, ex.loss_mask), {"tokens": jnp.sum(ex.loss_mask.array)}

        trainable, opt_state, metrics = loss_step(loss_fn, trainable, opt_state, optimizer, self._shard_params)
        return lora.join(trainable, frozen), opt_state, metrics

    def _supervised_nll_impl(self, model, ex: RlExample):
        lp, _ = token_logprobs(model, ex.input_ids, ex.position_ids, ex.segment_ids, temperature=1.0)
        mask = ex.loss_mask.array
        return -jnp.sum(jnp.where(mask, lp.array, 0.0)), jnp.sum(mask)

    def warm_start(self, examples: list[tuple[list[int], list[int]]], max_seq_len: int, seed: int = 0) -> dict:
        """Supervised training on (prompt_ids, completion_ids) pairs for `warm_start.steps` steps.

        Uses its own AdamW state; the RL optimizer starts fresh afterwards. With `loss.kl_coef > 0` the result becomes
        the frozen reference model. Returns the loss curve.
        """
        cfg = self.config.warm_start
        if cfg.steps <= 0 or not examples:
            self.add_adapters()
            return {"losses": []}
        if self.mesh is not None:
            self._check_rows(cfg.batch_rows, "learner.warm_start.batch_rows")
        cached = self._warm_start_cache_path(examples, max_seq_len, seed)
        stored = warm_start_cache.load(cached, self.model) if cached else None
        if stored is not None:
            model, result = stored
            with self._sharding():
                self.model = self._shard_params(model)
            logger.info(
                "warm start: reused an identical earlier one (%d steps, %.1f s when trained, final loss %.4f) from %s",
                cfg.steps,
                result["seconds"],
                result["losses"][-1],
                cached,
            )
            result = {**result, "cached": cached}
        else:
            result = self._train_warm_start(examples, max_seq_len, seed)
            if cached:
                warm_start_cache.save(cached, self.model, result)
        self.freeze_reference()  # the KL penalty's reference is the warm-started policy
        if self.critic is not None:
            self.critic.reset_from(self.model)  # a critic from the policy starts from the warm-started trunk
        self.add_adapters()  # with LoRA: the warm-started policy is the base
        return result

    def _warm_start_cache_path(self, examples: list[tuple[list[int], list[int]]], max_seq_len: int, seed: int):
        """Where this warm start's result is cached (`warm_start.cache_dir`), or None when it is not: no cache
        directory, several processes, or a policy above `cache_max_mb`."""
        cfg = self.config.warm_start
        size_mb = sum(x.nbytes for x in jax.tree_util.tree_leaves(eqx.filter(self.model, eqx.is_array))) / 2**20
        if not cfg.cache_dir or jax.process_count() > 1 or size_mb > cfg.cache_max_mb:
            return None
        devices = jax.devices()
        layout = {
            "platform": devices[0].platform,
            "device_kind": devices[0].device_kind,
            "devices": len(devices),
            "mesh": None if self.mesh is None else dict(self.mesh.shape),
            "mesh_config": repr(self.config.mesh),
        }
        settings = {
            "steps": cfg.steps,
            "learning_rate": cfg.learning_rate,
            "batch_rows": cfg.batch_rows,
            "max_seq_len": max_seq_len,
            "seed": seed,
        }
        key = warm_start_cache.cache_key(self.model, repr(self.model_config), examples, settings, layout)
        return warm_start_cache.entry_path(cfg.cache_dir, key)

    def _train_warm_start(self, examples: list[tuple[list[int], list[int]]], max_seq_len: int, seed: int) -> dict:
        """The warm start's supervised steps (see `warm_start`); returns the loss curve and the seconds taken."""
        cfg = self.config.warm_start
        opt = optax.adamw(cfg.learning_rate, b1=0.9, b2=0.99)
        opt_state = self.supervised_optimizer_state(opt)
        rng = np.random.default_rng(seed)
        seqs = [Sequence.supervised(p, c) for p, c in examples]
        mean_len = float(np.mean([len(s) for s in seqs]))
        per_batch = max(1, int(cfg.batch_rows * max_seq_len / mean_len))
        losses = []
        start = time.time()
        # a bar on a terminal; elsewhere a line every tenth of the way (and every 30 s) with the rate and ETA
        with StepProgress("warm start", cfg.steps, every=max(1, cfg.steps // 10), log=logger) as progress:
            for i in range(cfg.steps):
                if self.interrupted.is_set():
                    raise KeyboardInterrupt(f"warm start interrupted after {i} of {cfg.steps} steps")
                idx = rng.choice(len(seqs), size=min(per_batch, len(seqs)), replace=False)
                batch, _ = pack([seqs[j] for j in idx], cfg.batch_rows, max_seq_len)
                opt_state, metrics = self.supervised_step(batch, opt, opt_state)
                losses.append(float(metrics["loss"]))
                progress.advance_to(i + 1, f"loss {losses[-1]:.4f}")
        return {"losses": losses, "seconds": time.time() - start}
