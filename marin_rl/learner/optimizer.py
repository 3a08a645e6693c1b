"""The optimizer config shared by the policy, the critic and supervised fine-tuning: AdamW with gradient clipping
and a learning-rate schedule. optax is imported where the optimizer is built, not with the config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from marin_rl.bounds import bounded, check_fields

if TYPE_CHECKING:
    import optax

LR_SCHEDULES = ("constant", "linear", "cosine")
"""The values of `optimizer.schedule`."""


@dataclass
class OptimizerConfig:
    """AdamW with global-norm gradient clipping and a learning-rate schedule: linear warmup from 0, then constant,
    linear decay or cosine decay. Schedules count optimizer steps (a train step takes `minibatches × epochs`)."""

    learning_rate: float = bounded(1e-4, gt=0)
    """Peak learning rate."""
    warmup_steps: int = bounded(0, ge=0)
    """Linear warmup from 0 over this many optimizer steps (0: none)."""
    schedule: str = "constant"
    """After the warmup: 'constant', 'linear' (to min_lr_ratio × peak over decay_steps) or 'cosine' (half a cosine
    from the peak to min_lr_ratio × peak over decay_steps); the rate stays at its final value afterwards."""
    decay_steps: int | None = bounded(None, ge=1)
    """Optimizer steps of the decay after the warmup ('linear' and 'cosine' need it: e.g. the run's train steps ×
    minibatches × epochs, minus warmup_steps)."""
    min_lr_ratio: float = bounded(0.0, ge=0, le=1)
    """Final learning rate of a decay, as a fraction of the peak, in [0, 1] (0: decays to 0)."""
    weight_decay: float = bounded(0.0, ge=0)
    """Decoupled weight decay (0: none)."""
    beta1: float = bounded(0.9, ge=0, lt=1)
    """Adam β1, in [0, 1) (0: no momentum)."""
    beta2: float = bounded(0.99, gt=0, lt=1)
    """Adam β2, in (0, 1)."""
    eps: float = bounded(1e-8, gt=0)
    """Adam ε."""
    max_grad_norm: float | None = bounded(1.0, gt=0)
    """Clip gradients to this global norm (None: no clipping)."""

    def __post_init__(self):
        if self.schedule not in LR_SCHEDULES:
            raise ValueError(f"optimizer.schedule must be one of {LR_SCHEDULES}, got {self.schedule!r}")
        check_fields(self, "optimizer")
        if self.schedule != "constant" and (self.decay_steps is None or self.decay_steps < 1):
            raise ValueError(
                f"optimizer.schedule {self.schedule!r} needs decay_steps >= 1 (optimizer steps after the "
                f"warmup), got {self.decay_steps}"
            )

    def learning_rate_schedule(self) -> optax.Schedule:
        """The learning rate as a function of the optimizer step count (optax schedule)."""
        import optax

        peak, final = self.learning_rate, self.learning_rate * self.min_lr_ratio
        if self.schedule == "linear":
            decay = optax.linear_schedule(peak, final, self.decay_steps)
        elif self.schedule == "cosine":
            decay = optax.cosine_decay_schedule(peak, self.decay_steps, alpha=self.min_lr_ratio)
        else:
            decay = optax.constant_schedule(peak)
        if self.warmup_steps == 0:
            return decay
        return optax.join_schedules([optax.linear_schedule(0.0, peak, self.warmup_steps), decay], [self.warmup_steps])

    def build(self) -> optax.GradientTransformation:
        """The optax optimizer: global-norm clipping (when `max_grad_norm` is set), then AdamW at the scheduled rate."""
        import optax

        scheduled = self.warmup_steps > 0 or self.schedule != "constant"
        lr = self.learning_rate_schedule() if scheduled else self.learning_rate  # a constant keeps a stateless scale
        chain = []
        if self.max_grad_norm is not None:
            chain.append(optax.clip_by_global_norm(self.max_grad_norm))
        chain.append(optax.adamw(lr, b1=self.beta1, b2=self.beta2, eps=self.eps, weight_decay=self.weight_decay))
        return optax.chain(*chain)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (counted from 0)."""
        return float(self.learning_rate_schedule()(step))
