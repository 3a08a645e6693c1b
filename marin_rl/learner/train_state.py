"""The learner's train state: everything training changes, as one pytree, which is also the learner's part of a
checkpoint (its field names are the checkpoint's array paths: `model/...`, `opt_state/...`, `critic/...`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx


class TrainState(eqx.Module):
    """The policy, its optimizer state, the frozen KL reference, the counters, and the critic with its own optimizer
    state and counter. A `Learner` holds one and each of its steps replaces it; `Learner.state()` is it with the
    counters as arrays (what a checkpoint stores) and `Learner.load_state` takes one back."""

    model: Any
    """The policy (with LoRA: the frozen base with its adapters)."""
    opt_state: Any
    """The RL optimizer's state over the trainable parameters (with LoRA: None until the adapters exist)."""
    reference_model: Any = None
    """The frozen copy of the policy that the KL penalty compares with (None: no KL penalty, or LoRA's base)."""
    version: Any = 0
    """The policy version: learner steps taken (an int; an int32 array in a checkpoint)."""
    optimizer_steps: Any = 0
    """Optimizer steps taken by the RL optimizer (a learner step takes `minibatches × epochs`)."""
    critic: Any = None
    """The critic's trained model (a `ValueModel`, or only its head on the policy's trunk), or None without one."""
    critic_opt_state: Any = None
    """The critic's optimizer state (None without a critic)."""
    critic_steps: Any = None
    """Critic optimizer steps taken (None without a critic)."""

    @property
    def has_reference(self) -> bool:
        """Whether a frozen reference model is held."""
        return self.reference_model is not None

    @property
    def has_critic(self) -> bool:
        """Whether a critic is trained."""
        return self.critic is not None

    def replace(self, **changes: Any) -> TrainState:
        """This state with the given fields replaced."""
        return dataclasses.replace(self, **changes)

    def laid_out(self, shard: Callable[[Any], Any], has_critic: bool) -> TrainState:
        """This state with its arrays passed through `shard` (a placement's parameter layout); the critic's fields
        are dropped (None) unless `has_critic`."""
        return self.replace(
            model=shard(self.model),
            opt_state=shard(self.opt_state),
            reference_model=None if self.reference_model is None else shard(self.reference_model),
            critic=shard(self.critic) if has_critic else None,
            critic_opt_state=shard(self.critic_opt_state) if has_critic else None,
        )

    def with_counters(self, convert: Callable[[Any], Any]) -> TrainState:
        """This state with its counters (`version`, `optimizer_steps`, `critic_steps` when set) passed through
        `convert`: to arrays for a checkpoint, back to ints after loading one."""
        steps = None if self.critic_steps is None else convert(self.critic_steps)
        return self.replace(
            version=convert(self.version), optimizer_steps=convert(self.optimizer_steps), critic_steps=steps
        )


def train_state_field(name: str, holder: Callable[[Any], Any] = lambda obj: obj) -> property:
    """A property that reads and writes field `name` of `holder(obj).train_state` (replacing the state): how a
    `Learner`'s `model`, `opt_state`, ... and its critic's `model`, `opt_state`, `steps` are its train state."""

    def get(obj):
        return getattr(holder(obj).train_state, name)

    def set_(obj, value):
        owner = holder(obj)
        owner.train_state = owner.train_state.replace(**{name: value})

    return property(get, set_, doc=f"The train state's `{name}` (`TrainState.{name}`).")
