"""The learner: a Levanter model trained with the clipped policy-gradient loss on packed batches.

`Learner` is the host driver: it holds the `TrainState`, places batches on the devices and calls the pure step
functions of `marin_rl.learner.step` through the step skeleton of `marin_rl.learner.loop`. Its other jobs live in
modules of their own: placement (`sharding`), LoRA publishing (`publish`), export (`export`), optimizer offload
(`offload`), the supervised step and the warm start (`supervised`), the critic (`critic`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Iterator

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from marin_rl.learner import export, offload, publish, supervised
from marin_rl.learner.algorithm import get_algorithm
from marin_rl.learner.batch import RlExample, row_slice, to_example
from marin_rl.learner.config import LearnerConfig, check_platform, routes_experts
from marin_rl.learner.critic import Critic
from marin_rl.learner.distributed import host_arrays
from marin_rl.learner.loop import Every, run_steps
from marin_rl.learner.loss_registry import LossSpec, get_loss
from marin_rl.learner.losses import combine_metrics
from marin_rl.learner.sharding import Sharding
from marin_rl.learner.step import PolicySetup, policy_logprobs, policy_step, prepare_logprobs, supervised_nll
from marin_rl.learner.step import supervised_step as compiled_supervised_step
from marin_rl.learner.train_state import TrainState, train_state_field
from marin_rl.model import lora
from marin_rl.model.build import build_model, parameter_count
from marin_rl.model.config import ModelConfig
from marin_rl.model.precision import resolve_compute_dtype
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


def check_rl_batch(
    batch: PackedBatch, config: LearnerConfig, sharding: Sharding, algorithm: str, reads_token_rewards: bool
) -> None:
    """Raise ValueError, saying what to change, when a batch does not split into the configured minibatches ×
    microbatches (over the mesh's batch shards), or carries per-token rewards exactly when the algorithm does not
    read them."""
    m, n = config.minibatches, config.microbatches
    if batch.num_rows % (m * n) != 0:
        raise ValueError(
            f"the batch's {batch.num_rows} rows do not split into learner.minibatches={m} × "
            f"learner.microbatches={n} equal parts; choose a row count divisible by {m * n}"
        )
    if sharding.mesh is not None:
        sharding.check_rows(batch.num_rows, "the batch", m * n)
    if batch.rewards is None and reads_token_rewards:
        raise ValueError(
            f"algorithm {algorithm!r} needs batches with per-token rewards: set replay.advantage_estimator: gae"
        )
    if batch.rewards is not None and not reads_token_rewards:
        raise ValueError(
            f"the batch carries per-token rewards (replay.advantage_estimator: gae) but algorithm {algorithm!r} does "
            "not use them: its group advantages are all 0 (choose an algorithm that does, e.g. learner.algorithm: ppo)"
        )


def minibatches(ex: RlExample, m: int, epochs: int, sharding: Sharding, in_step_first: bool) -> Iterator[RlExample]:
    """The minibatches of a placed batch, `epochs` passes over its `m` consecutive row ranges (each laid out over the
    mesh); with `in_step_first` the first has no proximal logprobs (its step takes them from its own forward)."""
    rows = ex.input_ids.axis_size("batch") // m
    for epoch in range(epochs):
        for i in range(m):
            sub = ex if m == 1 else sharding.batch(row_slice(ex, i * rows, (i + 1) * rows))
            if epoch == 0 and i == 0 and in_step_first and sub.proximal_logprobs is not None:
                sub = dataclasses.replace(sub, proximal_logprobs=None)
            yield sub


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
        config.mesh.check_model(model_config.architecture)
        self.mesh = config.mesh.build(single=routes_experts(model_config.architecture))
        """The device mesh, or None on a single device (no sharding at all) unless the model routes experts
        (Levanter's mixture-of-experts layers route tokens in a shard_map, which needs a mesh)."""
        self.sharding = Sharding(self.mesh, config.mesh)
        """Where parameters, optimizer states and batches live (shared with the critic)."""
        self.optimizer = config.optimizer.build()
        """The RL optimizer (`learner.optimizer`); each compiled policy step takes it, so it may be replaced."""
        dtype = resolve_compute_dtype(model_config.compute_dtype, self.sharding.platform)
        self.policy_setup = PolicySetup(
            config.loss, self.temperature, config.microbatches, self.sharding, dtype, config.moe.routing_replay
        )
        """What the policy's RL step is compiled for, its compute dtype too (`marin_rl.learner.step.policy_step`)."""
        self.model = build_model(model_config, vocab_size)
        self.num_params = parameter_count(self.model)
        with self.sharding.context():
            self.model = self.sharding.params(self.model)
        self.opt_state = None if config.lora.enabled else self.supervised_optimizer_state(self.optimizer)
        self.publisher = publish.Publisher()
        """With LoRA, whether the next publish carries the base (`publish_params`)."""
        self.algorithm = get_algorithm(config.algorithm)
        """The algorithm whose learner-side calls `train_step` runs (`learner.algorithm`)."""
        self.learner_calls = self.algorithm.learner_calls()
        self.reads_token_rewards = any("token_rewards" in c.reads for c in self.learner_calls)
        has_critic = "critic" in self.algorithm.roles
        self.critic = Critic(config.critic, model_config, vocab_size, self) if has_critic else None
        """The value model (an algorithm with a critic role, e.g. 'ppo'), or None."""
        self.loss = get_loss(config.loss.objective)
        """The configured loss (`loss.objective`, looked up in the loss registry); `train_step` may be given another."""
        self._offloaded: offload.Placement | None = None  # while the optimizer state is in host memory
        self.step_metrics: list[dict[str, float]] = []
        """Metrics of each optimizer step of the last `train_step`."""
        self.interrupted = threading.Event()
        """Set from another thread to end a warm start in progress after its current step (it raises
        KeyboardInterrupt): a run stopped during a long warm start stops within a step, not at its end."""
        self._policy_step = policy_step(self.policy_setup)
        self._supervised_step = compiled_supervised_step(self.sharding.params, dtype)
        self._prepare = eqx.filter_jit(lambda *a: prepare_logprobs(self.policy_setup, *a))
        replay = config.moe.routing_replay
        self._logprobs = eqx.filter_jit(
            lambda model, ex: policy_logprobs(model, ex, self.temperature, dtype, replay)[0].array
        )
        self._supervised_nll = eqx.filter_jit(lambda model, ex: supervised_nll(model, ex, dtype))
        logger.debug("learner: %s parameters", f"{self.num_params:,}")  # the driver and the programs say it
        if self.mesh is not None:
            logger.info("learner: mesh %s over %s devices", dict(self.mesh.shape), self.mesh.devices.size)

    # ---- LoRA (`marin_rl.learner.publish`) ---------------------------------------------------------------------
    def add_adapters(self) -> bool:
        """With `learner.lora`, wrap the policy's linear layers in adapters (once: the policy as it is becomes the
        frozen base) and start the RL optimizer over the adapters alone; False when there is nothing to do."""
        if not self.config.lora.enabled or lora.has_adapters(self.model):
            return False
        self.model = publish.add_adapters(self.model, self.config.lora, self.sharding)
        self.opt_state = self.supervised_optimizer_state(self.optimizer)
        self._offloaded = None
        return True

    def request_full_publish(self) -> None:
        """With LoRA: the next `publish_params` carries the base as well as the adapters (a server was replaced and
        knows no base)."""
        self.publisher.request_full()

    def publish_params(self):
        """What a version carries to the servers: the policy, or with LoRA the adapters' arrays, preceded by the
        base's on the first publish and after `request_full_publish` (`marin_rl.model.lora`)."""
        return self.publisher.params(self.model)

    def served_model(self):
        """The policy as servers run it: with LoRA, the adapters merged into the base (on the devices)."""
        return publish.served_model(self.model, self.sharding)

    def _reference(self, state: TrainState | None = None):  # the KL reference of `state` (default: the learner's)
        state = self.train_state if state is None else state
        return publish.kl_reference(state.model, state.reference_model, self.config.loss.kl_coef)

    # ---- placement (`marin_rl.learner.sharding`) ---------------------------------------------------------------
    @property
    def batch_shards(self) -> int:
        """Number of pieces the batch rows split into (the product of the mesh axes that `batch` maps to)."""
        return self.sharding.batch_shards

    def place_batch(self, batch: PackedBatch) -> RlExample:
        """The host batch as an example on the learner's devices (rows split over the mesh): the one host → device
        copy of a batch. Every step of a train step reads this example; nothing uploads the batch again."""
        return self.sharding.place(batch)

    def freeze_reference(self) -> bool:
        """Copy the current policy as the frozen reference of the KL penalty; no-op (False) when kl_coef = 0."""
        if self.config.loss.kl_coef <= 0:
            return False
        if self.config.lora.enabled:
            logger.info("learner: the KL reference is the LoRA base (the policy with its adapters off)")
            return True
        copy = lambda x: jnp.copy(x) if eqx.is_array(x) else x  # noqa: E731
        self.reference_model = jax.tree_util.tree_map(copy, self.model, is_leaf=eqx.is_array)
        logger.info("learner: froze the reference model at policy version %d", self.version)
        return True

    # ---- RL ----------------------------------------------------------------------------------------------------
    def train_step(self, batch: PackedBatch, loss=None, loss_weight_fn=None) -> dict[str, float]:
        """Train on a packed batch (`minibatches × epochs` optimizer steps); increments the policy version by one.

        `loss`: a registered loss's name, a loss function or a `LossSpec` (default: the configured `loss.objective`);
        `loss_weight_fn(chunk) -> scalar` weighs the microbatch chunks of an optimizer step when their gradients are
        accumulated (see `marin_rl.learner.step.policy_update`). Both must be pure JAX functions (they are traced into
        the step). Returns `learner/...` metrics: those of the optimizer steps combined (mean; max of maxima, min of
        minima), `learner/optimizer_steps` (cumulative), the learning rate of the last step, timing and throughput.
        """
        loss = self.loss if loss is None else get_loss(loss)
        start = time.time()
        check_rl_batch(batch, self.config, self.sharding, self.algorithm.name, self.reads_token_rewards)
        placed = self.place_batch(batch)
        self.add_adapters()
        self.restore_optimizer()
        # the algorithm's learner side, a plain function (`Algorithm.train_step`: e.g. PPO's values, GAE, actor, critic)
        metrics = self.algorithm.train_step(self, batch, placed, loss=loss, loss_weight_fn=loss_weight_fn)
        if self.config.offload_optimizer:
            self.offload_optimizer()
        self.version += 1
        metrics["learner/step_time_s"] = elapsed = time.time() - start
        tokens = self.config.epochs * float(np.sum(batch.segment_ids >= 0))
        return {**metrics, "learner/tokens_per_s": tokens / max(elapsed, 1e-9)}

    def actor_train(
        self, batch: PackedBatch, placed: RlExample, loss=None, loss_weight_fn=None, advantages=None
    ) -> dict[str, float]:
        """The policy's `minibatches × epochs` optimizer steps on a batch (`batch` on the host, `placed` on the
        devices by `place_batch`): the actor step of every algorithm. `advantages` (rows × positions, device or host)
        replaces the batch's own, e.g. a critic's GAE; `loss` and `loss_weight_fn` as in `train_step`. Returns the
        `learner/...` metrics of the steps combined, the trained tokens, the cumulative optimizer steps and the
        learning rate."""
        cfg = self.config
        loss = self.loss if loss is None else get_loss(loss)
        if advantages is not None:
            if not isinstance(advantages, hax.NamedArray):
                advantages = hax.named(jnp.asarray(advantages, jnp.float32), placed.advantages.axes)
            placed = self.sharding.batch(dataclasses.replace(placed, advantages=advantages))
        with self.sharding.context():
            device_metrics = self._run_steps(placed, loss, loss_weight_fn)
        self.step_metrics = [{f"learner/{k}": float(v) for k, v in s.items()} for s in jax.device_get(device_metrics)]
        check_finite_steps(self.step_metrics, self.version + 1, self.optimizer_steps + 1)
        stacked = {k: np.asarray([x[k] for x in self.step_metrics]) for k in self.step_metrics[0]}
        out = {k: float(v) for k, v in combine_metrics(stacked, rest="mean").items()}
        out["learner/trained_tokens"] = float(np.sum(batch.loss_mask))  # the batch's, not a minibatch's
        self.optimizer_steps += cfg.minibatches * cfg.epochs
        out["learner/optimizer_steps"] = float(self.optimizer_steps)
        out["learner/learning_rate"] = cfg.optimizer.lr_at(self.optimizer_steps - 1)
        return out

    def _run_steps(self, ex: RlExample, loss: LossSpec, loss_weight_fn) -> list[dict[str, jax.Array]]:
        """The optimizer steps of the placed batch `ex` through `run_steps`; their metrics, still on the devices."""
        cfg, setup = self.config, self.policy_setup
        m, e, n = cfg.minibatches, cfg.epochs, cfg.microbatches
        if cfg.loss.kl_coef > 0 and self._reference() is None:
            self.freeze_reference()
        if setup.needs_prepare(loss, m * e):
            ex = self._prepare(self.model, self._reference(), ex, m * n, setup.uses_proximal(loss))
        # The batch's first step runs at the proximal weights: it takes logp_prox = stop_gradient(logp) from its own
        # forward pass (ratio exactly 1), unless accumulating microbatches needs the kept tokens beforehand.
        in_step_first = not (n > 1 and setup.kept_depends_on_proximal(loss))

        def step(state, sub):  # the learner holds each new state: the policy's old arrays are freed as it goes
            reference, optimizer = self._reference(state), self.optimizer
            self.train_state, metrics = self._policy_step(state, reference, sub, optimizer, loss, loss_weight_fn)
            return self.train_state, metrics

        device_metrics = []
        keep = Every(1, lambda _step, _state, metrics: device_metrics.append(metrics))
        run_steps(self.train_state, minibatches(ex, m, e, self.sharding, in_step_first), step, every=[keep])
        return device_metrics

    # ---- optimizer state in host memory (`marin_rl.learner.offload`) -------------------------------------------
    def offload_optimizer(self) -> None:
        """Move the optimizer state to host memory (pinned host memory where the devices have it, else host arrays);
        `restore_optimizer` (which `train_step` calls) puts it back with its shardings. No-op when offloaded."""
        if self._offloaded is None:
            self.opt_state, self._offloaded = offload.offload(self.opt_state)

    def restore_optimizer(self) -> None:
        """Bring an offloaded optimizer state back to the devices, each array with its sharding (no-op otherwise)."""
        if self._offloaded is not None:
            self.opt_state, self._offloaded = offload.restore(self.opt_state, self._offloaded), None

    # ---- evaluation and export ---------------------------------------------------------------------------------
    def logprobs(self, batch: PackedBatch) -> np.ndarray:
        """Learner's logprob of every token of a packed batch under the current weights (on every process of a
        multi-host learner: all must call it)."""
        if self.mesh is None:
            return np.asarray(self._logprobs(self.model, to_example(batch)))
        with self.sharding.context():  # rows padded to split evenly over the mesh; the padding is dropped
            [lp] = host_arrays([self._logprobs(self.model, self.place_batch(self.sharding.padded(batch)))])
        return lp[: batch.num_rows]

    def weights(self) -> list[np.ndarray]:
        """Current parameters as host arrays, flattened like `eqx.filter(model, eqx.is_array)` (a multi-host learner
        gathers them: every process must call it)."""
        params = self.publish_params()
        return host_arrays(params if isinstance(params, list) else lora.array_leaves(params))

    def export_hf(self, path: str, tokenizer) -> str:
        """Save the current policy and `tokenizer` as a Hugging Face checkpoint at `path` (`export.export_hf`; every
        process of a multi-host learner must call it). With LoRA the adapters name `model.init_from_hf` as their
        base when a warm start left it unchanged, else a base written beside them."""
        base = self.model_config.init_from_hf if self.config.warm_start.steps <= 0 else None
        return export.export_hf(self.model, path, tokenizer, self.sharding, self.config.lora, base)

    # ---- checkpoint state ----------------------------------------------------------------------------------------
    def state(self) -> TrainState:
        """Everything a resumed run needs from the learner: the train state with its counters as int32 arrays
        (replicated over the mesh), the optimizer state on the devices."""
        self.restore_optimizer()  # a checkpoint holds device arrays with their shardings
        self.add_adapters()  # with LoRA, a checkpoint always holds the adapted policy and the adapters' optimizer
        return self.train_state.with_counters(self.sharding.replicated)

    def state_template(self, has_reference: bool) -> TrainState:
        """A state shaped like `state()` (the current arrays as exemplars) for loading a checkpoint into; with
        `has_reference` it has a reference-model slot even if this learner has not frozen one yet."""
        template = self.state()
        reference = (template.reference_model if template.has_reference else self.model) if has_reference else None
        return template.replace(reference_model=reference)

    def load_state(self, state: TrainState) -> None:
        """Continue from a `state()` (e.g. loaded from a checkpoint): arrays are laid out by the parameter mapping."""
        with self.sharding.context():
            self.train_state = state.with_counters(int).laid_out(self.sharding.params, self.critic is not None)
        self._offloaded = None
        self.publisher.request_full()

    # ---- supervised training: the warm start and `learner.mode: sft` (`marin_rl.learner.supervised`) -----------
    def supervised_optimizer_state(self, optimizer: optax.GradientTransformation) -> optax.OptState:
        """A fresh `optimizer` state (supervised or RL) for the trainable parameters (LoRA: the adapters), sharded."""
        return supervised.optimizer_state(self.model, optimizer, self.sharding)

    def supervised_step(
        self, batch: PackedBatch, optimizer: optax.GradientTransformation, opt_state: optax.OptState
    ) -> tuple[optax.OptState, dict[str, jax.Array]]:
        """One optimizer step of the supervised loss on a packed batch (`marin_rl.learner.step.supervised_update`):
        updates the policy but not its version. `optimizer` must stay the same object between steps (it is part of
        the compiled step). Returns the new optimizer state and, on the devices, `loss`, `grad_norm` and `tokens`."""
        state, metrics = self.supervised_state_step(TrainState(self.model, opt_state), batch, optimizer)
        self.model = state.model
        return state.opt_state, metrics

    def supervised_state_step(self, state: TrainState, batch: PackedBatch, optimizer) -> tuple[TrainState, dict]:
        """`supervised_step` of a given state (its `opt_state` a state of `optimizer`): (new state, metrics)."""
        self.sharding.check_rows(batch.num_rows, "the supervised batch")
        with self.sharding.context():
            return self._supervised_step(state, self.place_batch(batch), optimizer)

    def supervised_nll(self, batch: PackedBatch) -> tuple[float, int]:
        """Sum of the negative log-likelihoods (temperature 1) of the batch's loss-masked tokens under the current
        weights, and their number."""
        self.sharding.check_rows(batch.num_rows, "the supervised batch")
        with self.sharding.context():
            total, count = self._supervised_nll(self.model, self.place_batch(batch))
        return float(total), int(count)

    def warm_start(self, examples: list[tuple[list[int], list[int]]], max_seq_len: int, seed: int = 0) -> dict:
        """Supervised training on (prompt_ids, completion_ids) pairs for `warm_start.steps` steps.

        Uses its own AdamW state; the RL optimizer starts fresh afterwards. With `loss.kl_coef > 0` the result becomes
        the frozen reference model. Returns the loss curve.
        """
        cfg = self.config.warm_start
        if cfg.steps <= 0 or not examples:
            self.add_adapters()
            return {"losses": []}
        self.sharding.check_rows(cfg.batch_rows, "learner.warm_start.batch_rows")  # (always true on one device)

        def step(state, batch, optimizer):  # the policy follows the steps: old arrays freed, an interrupted one kept
            state, metrics = self.supervised_state_step(state, batch, optimizer)
            self.model = state.model
            return state, metrics

        where = (repr(self.model_config), cfg, self.sharding, examples, max_seq_len, seed)
        self.model, result = supervised.warm_start(self.model, step, *where, stop=self.interrupted)
        self.freeze_reference()  # the KL penalty's reference is the warm-started policy
        if self.critic is not None:
            self.critic.reset_from(self.model)  # a critic from the policy starts from the warm-started trunk
        self.add_adapters()  # with LoRA: the warm-started policy is the base
        return result
