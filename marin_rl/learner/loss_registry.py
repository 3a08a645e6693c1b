"""The loss registry: losses by name (`register_loss`, `get_loss`), what `learner.loss.objective` and
`TrainEngine.train_batch(loss_fn=...)` name.

A loss is any pure JAX function of (logprobs, entropy, batch) returning (loss, metrics), registered with what it
declared about its inputs (`LossSpec`). The built-in losses ('decoupled', 'ppo', 'gspo' and the distillation
losses) are registered by `marin_rl.learner.losses`, which a lookup imports first, so that every name is checked
against them too; this module itself imports no JAX, so a config can hold a loss's name without loading it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BUILTIN_LOSSES_MODULE = "marin_rl.learner.losses"
"""The module that registers the built-in losses, imported by the first lookup (`known_losses`, or `get_loss` of a
name not registered yet): it imports JAX."""

LossFn = Callable[..., tuple[Any, dict[str, Any]]]
"""fn(logprobs, entropy, batch[, config=..., normalizers=...]) -> (scalar loss to minimise, metrics): JAX arrays."""


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: its name, the function and what it declared about its inputs."""

    name: str
    """Name it is looked up by (`LossConfig.objective`, `train_batch(loss_fn=...)`)."""
    fn: LossFn
    """The pure JAX function: (logprobs, entropy, batch) -> (loss, metrics), `haliax` named arrays in."""
    uses_proximal: bool = False
    """The loss reads `batch.proximal_logprobs`: when a batch takes several optimizer steps (minibatches × epochs),
    the learner fills them in (the weights before the batch's first step) before the first one. It is None in a
    batch's first step, where the current weights are the proximal policy (`proximal_logprobs` helps)."""
    takes_config: bool = False
    """The function accepts a `config` keyword (the run's `LossConfig`); detected from its signature."""
    takes_normalizers: bool = False
    """The function accepts a `normalizers` keyword (`LossNormalizers` of the whole minibatch under gradient
    accumulation, None otherwise); detected from its signature."""
    takes_student_top_logprobs: bool = False
    """The function accepts a `student_top_logprobs` keyword: the learner's logprobs (differentiable, from the same
    forward pass as `logprobs`) of the teacher's top-k tokens at each position, over the axes of
    `batch.teacher_top_ids`; detected from its signature."""

    def __call__(
        self,
        logprobs,
        entropy,
        batch,
        *,
        config=None,
        normalizers=None,
        student_top_logprobs=None,
    ):
        """Evaluate the loss, passing `config`, `normalizers` and `student_top_logprobs` only to a function that
        declared them."""
        kwargs = {}
        if self.takes_config:
            kwargs["config"] = config
        if self.takes_normalizers:
            kwargs["normalizers"] = normalizers
        if self.takes_student_top_logprobs:
            kwargs["student_top_logprobs"] = student_top_logprobs
        return self.fn(logprobs, entropy, batch, **kwargs)


_LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, *, uses_proximal: bool = False) -> Callable[[LossFn], LossFn]:
    """Decorator: register `fn(logprobs, entropy, batch) -> (loss, metrics)` under `name` and return `fn` unchanged.

    `logprobs` and `entropy` are `(batch, position)` named arrays of the learner's per-token log-probabilities (at the
    sampling temperature, differentiable) and entropies; `batch` is the `RlExample` (loss_mask, advantages,
    sampler_logprobs, segment_ids, token_versions, optional proximal/reference logprobs). The loss must ignore
    positions where `loss_mask` is false. Registering a taken name replaces the loss (with a new function) or does
    nothing (the same function again), so a module may be imported twice.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"a loss name must be a non-empty string without ':', got {name!r}")

    def decorator(fn: LossFn) -> LossFn:
        if not callable(fn):
            raise TypeError(f"register_loss({name!r}) needs a function, got {fn!r}")
        _LOSSES[name] = _spec(name, fn, uses_proximal)
        return fn

    return decorator


def _spec(name: str, fn: LossFn, uses_proximal: bool) -> LossSpec:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    return LossSpec(
        name, fn, uses_proximal, "config" in params, "normalizers" in params, "student_top_logprobs" in params
    )


def _with_builtins() -> dict[str, LossSpec]:
    """The registry, after the built-in losses' module has registered them (imported on the first call)."""
    importlib.import_module(BUILTIN_LOSSES_MODULE)
    return _LOSSES


def known_losses() -> list[str]:
    """Names of the registered losses (the built-in ones included)."""
    return sorted(_with_builtins())


def get_loss(name_or_fn: str | LossFn | LossSpec) -> LossSpec:
    """The registered loss called `name`; 'package.module:function' imports the module first (registering what it
    registers) and takes that function (registered under the path when it was not); a function or a `LossSpec` is
    returned as a spec as it is (not registered). Raises ValueError naming the known losses when there is none."""
    if isinstance(name_or_fn, LossSpec):
        return name_or_fn
    if callable(name_or_fn):
        for spec in _LOSSES.values():
            if spec.fn is name_or_fn:
                return spec
        return _spec(getattr(name_or_fn, "__name__", "custom"), name_or_fn, False)
    name = name_or_fn
    if name in _LOSSES or name in _with_builtins():
        return _LOSSES[name]
    if isinstance(name, str) and ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"loss {name!r} cannot be imported: {e}") from e
        for spec in _LOSSES.values():
            if spec.fn is fn:
                return spec
        if not callable(fn):
            raise ValueError(f"loss {name!r} is not a function")
        _LOSSES[name] = _spec(name, fn, False)
        return _LOSSES[name]
    raise ValueError(f"unknown loss {name!r}; registered: {known_losses()} (or give 'package.module:function')")
