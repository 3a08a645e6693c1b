"""`TrainEngine`: the Levanter learner behind a small surface, and `make_batch` from groups to a packed batch."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax
import numpy as np

from marin_rl.broadcast.base import WeightUpdate, make_transport
from marin_rl.checkpoint_dirs import begin_checkpoint
from marin_rl.config import RunConfig
from marin_rl.envs.base import Environment, reference_examples
from marin_rl.learner.checkpoint import load_learner_state, save_learner_state
from marin_rl.learner.distributed import is_primary
from marin_rl.learner.learner import Learner
from marin_rl.learner.loss_registry import get_loss
from marin_rl.replay.advantages import rloo
from marin_rl.replay.batcher import FormedBatch
from marin_rl.replay.packing import Sequence, pack
from marin_rl.replay.validation import GroupRejected, check_group
from marin_rl.tokenizer import load_tokenizer
from marin_rl.types import PackedBatch, Rollout, RolloutGroup


def make_batch(
    groups: list[RolloutGroup],
    num_rows: int,
    row_len: int,
    advantages: Callable[[np.ndarray], np.ndarray] = rloo,
    token_advantages: Callable[[list[Rollout]], list[np.ndarray]] | None = None,
) -> PackedBatch:
    """Score each group with `advantages(rewards) -> one advantage per rollout` (e.g. `marin_rl.replay.advantages`
    `rloo`, `grpo`), or, when given, `token_advantages(rollouts) -> one array per rollout, one advantage per token`
    (e.g. `lambda rs: turn_rloo_token_advantages(rs, 0.0)` for per-turn credit), and pack every rollout, token-exact,
    into a `(num_rows, row_len)` batch (several per row). Every group is validated first, with the replay buffers'
    check (`marin_rl.replay.validation.check_group`; the vocabulary size is unknown here, so token ids need only be
    non-negative integers). Raises ValueError naming the group and the reason code of an invalid group, when the
    rollouts do not all fit (choose more rows) or when a group's advantages have the wrong length."""
    for group in groups:
        try:
            check_group(group, group.environment, None)
        except GroupRejected as e:
            raise ValueError(
                f"group {group.group_id} ({group.environment}, problem {group.problem_id}) is invalid "
                f"({e.reason}): {e.detail}"
            ) from e
    seqs = []
    for group in groups:
        if token_advantages is not None:
            per_token = list(token_advantages(group.rollouts))
            if len(per_token) != len(group.rollouts):
                raise ValueError(
                    f"token_advantages gave {len(per_token)} arrays for the {len(group.rollouts)} "
                    f"rollouts of group {group.group_id}"
                )
            seqs += [
                Sequence.from_rollout(r, 0.0, token_advantages=np.asarray(a, np.float32))
                for r, a in zip(group.rollouts, per_token, strict=True)
            ]
            continue
        adv = np.asarray(advantages(group.rewards), dtype=np.float64)
        if adv.shape != (len(group.rollouts),):
            raise ValueError(
                f"advantages of group {group.group_id} have shape {adv.shape}, expected ({len(group.rollouts)},)"
            )
        seqs += [Sequence.from_rollout(r, float(a)) for r, a in zip(group.rollouts, adv, strict=True)]
    batch, placed = pack(seqs, num_rows, row_len)
    if len(placed) != len(seqs):
        raise ValueError(
            f"only {len(placed)} of {len(seqs)} rollouts fit {num_rows} rows of {row_len} tokens; "
            "pass more rows or fewer groups"
        )
    return batch


class TrainEngine:
    """The policy and its optimizer (a `Learner` built from `run_config.model` and `run_config.learner`, on its
    device mesh) and a weight transport (`run_config.broadcast`). Every method blocks until its work is done.

    The orchestrator's learner processes are `TrainEngine`s too. In a multi-host learner (one process per host, in
    the distributed runtime), every process builds one and makes every call in the same order (they are
    collectives); process 0 holds the transport, publishes and writes single-copy files."""

    def __init__(self, run_config: RunConfig, *, tokenizer=None, transport: bool = True):
        self.config = run_config
        self.tokenizer = tokenizer or load_tokenizer(run_config.tokenizer)
        temperature = run_config.sampling_temperature
        self.learner = Learner(run_config.model, run_config.learner, len(self.tokenizer), temperature=temperature)
        # transport=False: the weights never leave this process (a colocated engine reads the learner's own arrays)
        self.transport = make_transport(run_config.broadcast) if transport and is_primary() else None

    @property
    def version(self) -> int:
        """Policy version: the number of `train_batch` calls since the start (or the loaded checkpoint's)."""
        return self.learner.version

    @property
    def learning_rate(self) -> float:
        """Learning rate of the next optimizer step (the warmup schedule follows optimizer steps; see
        `learner.optimizer`)."""
        return self.config.learner.optimizer.lr_at(self.learner.optimizer_steps)

    def warm_start(self, source: Environment | list[tuple[list[int], list[int]]], steps: int | None = None) -> dict:
        """Supervised steps (`learner.warm_start`; `steps` overrides its step count) on `source`: an environment's
        reference completions of its training problems, or (prompt_ids, completion_ids) pairs. Does not change the
        version. Returns the loss curve."""
        if isinstance(source, Environment):
            examples = reference_examples(source, self.tokenizer)
            if not examples:
                raise ValueError(f"environment {source.name} has no reference completions to warm-start on")
        else:
            examples = list(source)
        cfg = self.learner.config.warm_start
        if steps is not None:
            self.learner.config.warm_start = dataclasses.replace(cfg, steps=steps)
        try:
            return self.learner.warm_start(
                examples, self.config.batcher.max_seq_len, seed=self.config.orchestrator.seed
            )
        finally:
            self.learner.config.warm_start = cfg

    def train_batch(self, batch: PackedBatch | FormedBatch, loss_fn=None, loss_weight_fn=None) -> dict[str, float]:
        """Train on `batch` (a `PackedBatch`, or what `InferenceEngine.prepare_batch` formed) with
        `learner.minibatches × epochs` optimizer steps, and increment the version by one.

        `loss_fn`: a registered loss's name, or any pure JAX function (logprobs, entropy, batch) -> (loss, metrics)
        (default: `learner.loss.objective`). `loss_weight_fn(chunk) -> scalar`: the weight of each microbatch chunk
        when `learner.microbatches > 1` (default: its sampled tokens; the built-in losses are exactly normalised by
        the minibatch without one). Returns the `learner/...` metrics (the loss at the weights before the step).
        Raises ValueError for an unknown loss name or rows that do not split into minibatches × microbatches."""
        loss = None if loss_fn is None else get_loss(loss_fn)
        if isinstance(batch, FormedBatch):
            batch = batch.batch
        return self.learner.train_step(batch, loss=loss, loss_weight_fn=loss_weight_fn)

    def forward(self, batch: PackedBatch) -> np.ndarray:
        """The learner's log-probability of every token of `batch` under the current weights (at the sampling
        temperature), a `(rows, positions)` array aligned with `batch.input_ids` (0 at each row's first position)."""
        return self.learner.logprobs(batch)

    def publish(self) -> WeightUpdate | None:
        """Publish the current weights as `version` through the broadcast transport, without applying them anywhere;
        returns the update (None on processes other than 0). One process publishes the model's device arrays (cast
        on the device when `broadcast.dtype` asks); a multi-host learner gathers them first (a collective). Raises
        RuntimeError for an engine built with `transport=False`."""
        if is_primary() and self.transport is None:
            raise RuntimeError("this TrainEngine has no weight transport (built with transport=False)")
        if jax.process_count() == 1:
            return self.transport.publish(self.learner.version, self.learner.publish_params())
        leaves = self.learner.weights()
        return self.transport.publish(self.learner.version, leaves) if self.transport is not None else None

    def update_weights(self, inference=None) -> WeightUpdate | None:
        """`publish` and, given an `InferenceEngine`, make its servers serve the update (blocks until they do).
        Returns the update."""
        update = self.publish()
        if inference is not None and update is not None:
            inference.apply_update(update)
        return update

    def export_hf(self, path: str) -> str:
        """Save the current policy and the tokenizer as a Hugging Face checkpoint at `path` (local or fsspec URL),
        loadable by `transformers`, vLLM and `model.init_from_hf`; returns `path`."""
        return self.learner.export_hf(path, self.tokenizer)

    def save(self, path: str) -> str:
        """Write a checkpoint (policy, optimizer state, reference model, version) under directory `path` (local or
        fsspec URL) as `path/step-<version>`; returns that directory, complete when this returns."""
        ckpt = begin_checkpoint(path, self.learner.version)
        self.write_state(ckpt, self.learner.version)
        return ckpt

    def write_state(self, directory: str, step: int) -> None:
        """Write the learner's state into the prepared checkpoint directory `directory` (`begin_checkpoint`),
        completion marker last: a run checkpoint is the driver's state with this beside it. `step` is recorded as
        the checkpoint's step."""
        save_learner_state(self.learner, directory, step)

    def load(self, path: str) -> int:
        """Continue from a checkpoint directory written by `save` (or a run's `checkpoints/step-N`); returns its
        version. Raises FileNotFoundError for an incomplete or missing checkpoint."""
        if not os.path.exists(path) and "://" not in path:
            raise FileNotFoundError(path)
        load_learner_state(self.learner, path)
        return self.learner.version

    def close(self) -> None:
        """Release the weight transport (shared-memory slots, a Flight server)."""
        if self.transport is not None:
            self.transport.close()
