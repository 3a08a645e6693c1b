"""`TrainEngine`: the Levanter learner behind a small surface, and `make_batch` from groups to a packed batch."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from marin_rl.broadcast.base import WeightUpdate, make_transport
from marin_rl.config import RunConfig
from marin_rl.envs.base import Environment, reference_examples
from marin_rl.learner.checkpoint import begin_checkpoint, load_learner_state, save_learner_state
from marin_rl.learner.learner import Learner
from marin_rl.learner.losses import get_loss
from marin_rl.replay.advantages import rloo
from marin_rl.replay.packing import Sequence, pack
from marin_rl.tokenizer import load_tokenizer
from marin_rl.types import PackedBatch, RolloutGroup


def make_batch(
    groups: list[RolloutGroup],
    num_rows: int,
    row_len: int,
    advantages: Callable[[np.ndarray], np.ndarray] = rloo,
) -> PackedBatch:
    """Score each group with `advantages(rewards) -> one advantage per rollout` (e.g. `marin_rl.replay.advantages`
    `rloo`, `grpo`) and pack every rollout, token-exact, into a `(num_rows, row_len)` batch (several per row).
    Raises ValueError when they do not all fit (choose more rows) or a group's advantages have the wrong length."""
    seqs = []
    for group in groups:
        adv = np.asarray(advantages(group.rewards), dtype=np.float64)
        if adv.shape != (len(group.rollouts),):
            raise ValueError(f"advantages of group {group.group_id} have shape {adv.shape}, expected "
                             f"({len(group.rollouts)},)")  # fmt: skip
        seqs += [Sequence.from_rollout(r, float(a)) for r, a in zip(group.rollouts, adv, strict=True)]
    batch, placed = pack(seqs, num_rows, row_len)
    if len(placed) != len(seqs):
        raise ValueError(f"only {len(placed)} of {len(seqs)} rollouts fit {num_rows} rows of {row_len} tokens; "
                         "pass more rows or fewer groups")  # fmt: skip
    return batch


class TrainEngine:
    """The policy and its optimizer (a `Learner` built from `run_config.model` and `run_config.learner`, on its
    device mesh) and a weight transport (`run_config.broadcast`). Every method blocks until its work is done."""

    def __init__(self, run_config: RunConfig, *, tokenizer=None):
        self.config = run_config
        self.tokenizer = tokenizer or load_tokenizer(run_config.tokenizer)
        temperature = run_config.envs[0].sampling.temperature
        self.learner = Learner(run_config.model, run_config.learner, len(self.tokenizer), temperature=temperature)
        self.transport = make_transport(run_config.broadcast)

    @property
    def version(self) -> int:
        """Policy version: the number of `train_batch` calls since the start (or the loaded checkpoint's)."""
        return self.learner.version

    @property
    def learning_rate(self) -> float:
        """Learning rate of the next optimizer step (the warmup schedule follows optimizer steps; see
        `learner.optimizer`)."""
        return self.config.learner.optimizer.lr_at(self.learner.optimizer_steps)

    def warm_start(self, env: Environment, steps: int | None = None) -> dict:
        """Supervised steps on `env`'s reference completions of its training problems (`learner.warm_start`;
        `steps` overrides its step count). Does not change the version. Returns the loss curve."""
        examples = reference_examples(env, self.tokenizer)
        if not examples:
            raise ValueError(f"environment {env.name} has no reference completions to warm-start on")
        cfg = self.learner.config.warm_start
        if steps is not None:
            self.learner.config.warm_start = type(cfg)(steps=steps, learning_rate=cfg.learning_rate,
                                                       batch_rows=cfg.batch_rows)  # fmt: skip
        try:
            return self.learner.warm_start(
                examples, self.config.batcher.max_seq_len, seed=self.config.orchestrator.seed
            )
        finally:
            self.learner.config.warm_start = cfg

    def train_batch(self, batch: PackedBatch, loss_fn=None, loss_weight_fn=None) -> dict[str, float]:
        """Train on `batch` (`learner.minibatches × epochs` optimizer steps) and increment the version by one.

        `loss_fn`: a registered loss's name, or any pure JAX function (logprobs, entropy, batch) -> (loss, metrics)
        (default: `learner.loss.objective`). `loss_weight_fn(chunk) -> scalar`: the weight of each microbatch chunk
        when `learner.microbatches > 1` (default: its sampled tokens; the built-in losses are exactly normalised by
        the minibatch without one). Returns the `learner/...` metrics (the loss at the weights before the step).
        Raises ValueError for an unknown loss name or rows that do not split into minibatches × microbatches."""
        loss = None if loss_fn is None else get_loss(loss_fn)
        return self.learner.train_step(batch, loss=loss, loss_weight_fn=loss_weight_fn)

    def forward(self, batch: PackedBatch) -> np.ndarray:
        """The learner's log-probability of every token of `batch` under the current weights (at the sampling
        temperature), a `(rows, positions)` array aligned with `batch.input_ids` (0 at each row's first position)."""
        return self.learner.logprobs(batch)

    def update_weights(self, inference=None) -> WeightUpdate:
        """Publish the current weights as `version` through the broadcast transport and, given an
        `InferenceEngine`, make its servers serve them (blocks until they do). Returns the update."""
        update = self.transport.publish(self.learner.version, self.learner.model)
        if inference is not None:
            inference.apply_update(update)
        return update

    def save(self, path: str) -> str:
        """Write a checkpoint (policy, optimizer state, reference model, version) under directory `path` (local or
        fsspec URL) as `path/step-<version>`; returns that directory, complete when this returns."""
        ckpt = begin_checkpoint(path, self.learner.version)
        save_learner_state(self.learner, ckpt, self.learner.version)
        return ckpt

    def load(self, path: str) -> int:
        """Continue from a checkpoint directory written by `save` (or a run's `checkpoints/step-N`); returns its
        version. Raises FileNotFoundError for an incomplete or missing checkpoint."""
        if not os.path.exists(path) and "://" not in path:
            raise FileNotFoundError(path)
        load_learner_state(self.learner, path)
        return self.learner.version

    def close(self) -> None:
        """Release the weight transport (shared-memory slots, a Flight server)."""
        self.transport.close()
