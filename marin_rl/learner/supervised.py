"""Supervised training of the policy: the optimizer state of the supervised step, and the warm start (supervised
steps on prompt/completion pairs before RL) with its cache of finished warm starts."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax

from marin_rl.learner import warm_start_cache
from marin_rl.learner.config import WarmStartConfig
from marin_rl.learner.loop import Every, Progress, run_steps
from marin_rl.learner.sharding import Sharding
from marin_rl.learner.train_state import TrainState
from marin_rl.model import lora
from marin_rl.replay.packing import Sequence, pack
from marin_rl.types import PackedBatch

logger = logging.getLogger("marin_rl.learner.learner")


def optimizer_state(model: Any, optimizer: optax.GradientTransformation, sharding: Sharding) -> optax.OptState:
    """A fresh state of `optimizer` for `model`'s trainable parameters (the adapters with LoRA), laid out like them
    on the mesh."""
    with sharding.context():
        trainable, _ = lora.split(model)
        return sharding.params(optimizer.init(eqx.filter(trainable, eqx.is_inexact_array)))


def warm_start_cache_path(
    model: Any,
    model_config_repr: str,
    cfg: WarmStartConfig,
    sharding: Sharding,
    examples: list[tuple[list[int], list[int]]],
    max_seq_len: int,
    seed: int,
) -> str | None:
    """Where this warm start's result is cached (`warm_start.cache_dir`), or None when it is not: no cache
    directory, several processes, or a policy above `cache_max_mb`."""
    size_mb = sum(x.nbytes for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))) / 2**20
    if not cfg.cache_dir or jax.process_count() > 1 or size_mb > cfg.cache_max_mb:
        return None
    devices = jax.devices()
    mesh = sharding.mesh
    layout = {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "mesh": None if mesh is None else dict(mesh.shape),
        "mesh_config": repr(sharding.config),
    }
    settings = {
        "steps": cfg.steps,
        "learning_rate": cfg.learning_rate,
        "batch_rows": cfg.batch_rows,
        "max_seq_len": max_seq_len,
        "seed": seed,
    }
    key = warm_start_cache.cache_key(model, model_config_repr, examples, settings, layout)
    return warm_start_cache.entry_path(cfg.cache_dir, key)


def warm_start_batches(
    examples: list[tuple[list[int], list[int]]], cfg: WarmStartConfig, max_seq_len: int, seed: int
) -> Iterator[PackedBatch]:
    """The warm start's batches, drawn lazily: each a seeded sample of the pairs (about `batch_rows` rows' worth of
    tokens) packed into `batch_rows × max_seq_len`."""
    rng = np.random.default_rng(seed)
    seqs = [Sequence.supervised(p, c) for p, c in examples]
    mean_len = float(np.mean([len(s) for s in seqs]))
    per_batch = max(1, int(cfg.batch_rows * max_seq_len / mean_len))
    while True:
        idx = rng.choice(len(seqs), size=min(per_batch, len(seqs)), replace=False)
        batch, _ = pack([seqs[j] for j in idx], cfg.batch_rows, max_seq_len)
        yield batch


def train_warm_start(
    state: TrainState,
    step_fn: Callable[[TrainState, PackedBatch], tuple[TrainState, dict[str, Any]]],
    examples: list[tuple[list[int], list[int]]],
    cfg: WarmStartConfig,
    max_seq_len: int,
    seed: int,
    stop: threading.Event | None = None,
) -> tuple[TrainState, dict]:
    """`cfg.steps` supervised steps (`step_fn`, with the warm start's optimizer state in `state.opt_state`) on
    batches of the pairs; `stop` set ends it after the current step (KeyboardInterrupt). Returns the final state and
    {losses, seconds}."""
    losses: list[float] = []
    start = time.time()
    # a bar on a terminal; elsewhere a line every tenth of the way (and every 30 s) with the rate and ETA
    progress = Progress("warm start", lambda _: f"loss {losses[-1]:.4f}", every=max(1, cfg.steps // 10), log=logger)
    state, _ = run_steps(
        state,
        warm_start_batches(examples, cfg, max_seq_len, seed),
        step_fn,
        total=cfg.steps,
        every=[Every(1, lambda _step, _state, metrics: losses.append(float(metrics["loss"])))],
        progress=progress,
        stop=stop,
        what="warm start",
    )
    return state, {"losses": losses, "seconds": time.time() - start}


def warm_start(
    model: Any,
    step: Callable[[TrainState, PackedBatch, optax.GradientTransformation], tuple[TrainState, dict[str, Any]]],
    model_config_repr: str,
    cfg: WarmStartConfig,
    sharding: Sharding,
    examples: list[tuple[list[int], list[int]]],
    max_seq_len: int,
    seed: int,
    stop: threading.Event | None = None,
) -> tuple[Any, dict]:
    """The warm start of `model`: an identical earlier one from `cfg.cache_dir` when there is one, else
    `train_warm_start` with a fresh AdamW state (`step(state, batch, optimizer)`: the supervised step), saved to the
    cache. Returns the warm-started model and {losses, seconds[, cached]}."""
    cached = warm_start_cache_path(model, model_config_repr, cfg, sharding, examples, max_seq_len, seed)
    stored = warm_start_cache.load(cached, model) if cached else None
    if stored is not None:
        model, result = stored
        with sharding.context():
            model = sharding.params(model)
        logger.info(
            "warm start: reused an identical earlier one (%d steps, %.1f s when trained, final loss %.4f) from %s",
            *(cfg.steps, result["seconds"], result["losses"][-1], cached),
        )
        return model, {**result, "cached": cached}
    optimizer = optax.adamw(cfg.learning_rate, b1=0.9, b2=0.99)
    state = TrainState(model, optimizer_state(model, optimizer, sharding))
    del model  # the steps replace it
    state, result = train_warm_start(
        state, lambda st, batch: step(st, batch, optimizer), examples, cfg, max_seq_len, seed, stop
    )
    if cached:
        warm_start_cache.save(cached, state.model, result)
    return state.model, result
