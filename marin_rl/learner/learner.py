"""The learner: a Levanter model trained with the clipped policy-gradient loss on packed batches."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import optax

from marin_rl.learner.losses import LossConfig, policy_loss, sft_loss
from marin_rl.learner.model import ModelConfig, build_model, parameter_count, token_logprobs
from marin_rl.replay.packing import Sequence, pack
from marin_rl.types import PackedBatch, RlExample

logger = logging.getLogger(__name__)


@dataclass
class OptimizerConfig:
    """AdamW with global-norm gradient clipping and linear warmup."""

    learning_rate: float = 1e-4
    """Peak learning rate."""
    warmup_steps: int = 0
    """Linear warmup from 0 over this many steps."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    beta1: float = 0.9
    """Adam β1."""
    beta2: float = 0.99
    """Adam β2."""
    eps: float = 1e-8
    """Adam ε."""
    max_grad_norm: float | None = 1.0
    """Clip gradients to this global norm (None: no clipping)."""

    def build(self) -> optax.GradientTransformation:
        if self.warmup_steps > 0:
            lr = optax.linear_schedule(0.0, self.learning_rate, self.warmup_steps)
        else:
            lr = self.learning_rate
        chain = []
        if self.max_grad_norm is not None:
            chain.append(optax.clip_by_global_norm(self.max_grad_norm))
        chain.append(optax.adamw(lr, b1=self.beta1, b2=self.beta2, eps=self.eps, weight_decay=self.weight_decay))
        return optax.chain(*chain)

    def lr_at(self, step: int) -> float:
        if self.warmup_steps > 0:
            return self.learning_rate * min(1.0, step / self.warmup_steps)
        return self.learning_rate


@dataclass
class WarmStartConfig:
    """Optional supervised warm start on the environments' reference solutions, before RL begins."""

    steps: int = 0
    """Supervised optimizer steps (0: none). The RL phase starts from the result, at policy version 0."""
    learning_rate: float = 3e-3
    """Learning rate of the warm start (AdamW, constant)."""
    batch_rows: int = 32
    """Rows of `max_seq_len` tokens per supervised batch."""


@dataclass
class LearnerConfig:
    """The learner: optimizer, loss and supervised warm start."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer of the RL phase."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Policy-gradient loss."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised warm start before RL."""


def _to_example(batch: PackedBatch) -> RlExample:
    Batch = hax.Axis("batch", batch.num_rows)
    Pos = hax.Axis("position", batch.seq_len)
    return RlExample.from_packed(batch, Batch, Pos)


class Learner:
    """Holds the policy and its optimizer state; each `train_step` is one optimizer step and one new version."""

    def __init__(self, model_config: ModelConfig, config: LearnerConfig, vocab_size: int, temperature: float = 1.0):
        self.config = config
        self.temperature = float(temperature)
        self.model = build_model(model_config, vocab_size)
        self.num_params = parameter_count(self.model)
        self.optimizer = config.optimizer.build()
        self.opt_state = self.optimizer.init(eqx.filter(self.model, eqx.is_inexact_array))
        self.version = 0
        self._train_step = eqx.filter_jit(self._train_step_impl, donate="all-except-first")
        self._logprobs = eqx.filter_jit(self._logprobs_impl)
        logger.info("learner: %s parameters", f"{self.num_params:,}")

    # ---- RL ----------------------------------------------------------------------------------------
    def _train_step_impl(self, model, opt_state, ex: RlExample):
        def loss_fn(m):
            lp, ent = token_logprobs(m, ex.input_ids, ex.position_ids, ex.segment_ids, temperature=self.temperature)
            return policy_loss(lp, ent, ex, self.config.loss)

        (_, metrics), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model)
        updates, opt_state = self.optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        model = eqx.apply_updates(model, updates)
        metrics["grad_norm"] = optax.global_norm(grads)
        return model, opt_state, metrics

    def train_step(self, batch: PackedBatch) -> dict[str, float]:
        """One optimizer step on a packed batch; increments the policy version. Returns `learner/...` metrics."""
        start = time.time()
        ex = _to_example(batch)
        self.model, self.opt_state, metrics = self._train_step(self.model, self.opt_state, ex)
        out = {f"learner/{k}": float(v) for k, v in jax.device_get(metrics).items()}
        out["learner/learning_rate"] = self.config.optimizer.lr_at(self.version)
        self.version += 1
        elapsed = time.time() - start
        out["learner/step_time_s"] = elapsed
        out["learner/tokens_per_s"] = float(np.sum(batch.segment_ids >= 0)) / max(elapsed, 1e-9)
        return out

    # ---- evaluation helpers ----------------------------------------------------------------------------
    def _logprobs_impl(self, model, ex: RlExample):
        lp, _ = token_logprobs(model, ex.input_ids, ex.position_ids, ex.segment_ids, temperature=self.temperature)
        return lp.array

    def logprobs(self, batch: PackedBatch) -> np.ndarray:
        """Learner's logprob of every token of a packed batch under the current weights."""
        return np.asarray(self._logprobs(self.model, _to_example(batch)))

    def weights(self) -> list[np.ndarray]:
        """Current parameters as host arrays, flattened like `eqx.filter(model, eqx.is_array)`."""
        return [np.asarray(x) for x in jax.device_get(jax.tree_util.tree_leaves(eqx.filter(self.model, eqx.is_array)))]

    def get_version(self) -> int:
        return self.version

    # ---- supervised warm start ----------------------------------------------------------------------
    def warm_start(self, examples: list[tuple[list[int], list[int]]], max_seq_len: int, seed: int = 0) -> dict:
        """Supervised training on (prompt_ids, completion_ids) pairs for `warm_start.steps` steps.

        Uses its own AdamW state; the RL optimizer starts fresh afterwards. Returns the loss curve.
        """
        cfg = self.config.warm_start
        if cfg.steps <= 0 or not examples:
            return {"losses": []}
        opt = optax.adamw(cfg.learning_rate, b1=0.9, b2=0.99)
        opt_state = opt.init(eqx.filter(self.model, eqx.is_inexact_array))

        @eqx.filter_jit
        def step(model, opt_state, ex: RlExample):
            def loss_fn(m):
                lp, _ = token_logprobs(m, ex.input_ids, ex.position_ids, ex.segment_ids, temperature=1.0)
                return sft_loss(lp, ex.loss_mask)

            loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
            updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
            return eqx.apply_updates(model, updates), opt_state, loss

        rng = np.random.default_rng(seed)
        seqs = [Sequence.supervised(p, c) for p, c in examples]
        mean_len = float(np.mean([len(s) for s in seqs]))
        per_batch = max(1, int(cfg.batch_rows * max_seq_len / mean_len))
        losses = []
        start = time.time()
        for i in range(cfg.steps):
            idx = rng.choice(len(seqs), size=min(per_batch, len(seqs)), replace=False)
            batch, _ = pack([seqs[j] for j in idx], cfg.batch_rows, max_seq_len)
            self.model, opt_state, loss = step(self.model, opt_state, _to_example(batch))
            losses.append(float(loss))
            if (i + 1) % max(1, cfg.steps // 10) == 0:
                logger.info("warm start step %d/%d: loss %.4f", i + 1, cfg.steps, losses[-1])
        return {"losses": losses, "seconds": time.time() - start}
