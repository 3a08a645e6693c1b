"""The learner's training batch on its devices: `RlExample`, a packed batch of haliax named arrays.

The replay side packs rollouts into a host `PackedBatch` of NumPy arrays (`marin_rl.types`); `RlExample.from_packed`
puts one on the devices, where the losses (`marin_rl.learner.losses`) read it.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

from marin_rl.types import TOKEN_FIELDS, PackedBatch, check_token_fields

TEACHER_TOP_K = "teacher_top_k"
"""Name of the axis of the teacher's top-k tokens in `RlExample.teacher_top_ids` / `teacher_top_logprobs`."""

_TRAILING_AXIS = {f.name: f.trailing_axis for f in TOKEN_FIELDS if f.top_k}
"""The trailing axis's name of each field that has one (`TokenField.trailing_axis`)."""
assert _TRAILING_AXIS["teacher_top_ids"] == TEACHER_TOP_K


class RlExample(eqx.Module):
    """A packed training batch of named arrays over `(batch, position)`.

    `sampler_logprobs[b, t]` is the sampler's log-probability of `input_ids[b, t]`; `loss_mask` is true only on
    tokens that the policy sampled. Several rollouts share a row, separated by `segment_ids`. Every field but
    `reference_logprobs` and `proximal_logprobs` is a packed one, declared (dtype, padding, meaning) in
    `marin_rl.types.TOKEN_FIELDS`.
    """

    input_ids: hax.NamedArray
    position_ids: hax.NamedArray
    segment_ids: hax.NamedArray
    loss_mask: hax.NamedArray
    advantages: hax.NamedArray
    sampler_logprobs: hax.NamedArray
    token_versions: hax.NamedArray
    reference_logprobs: hax.NamedArray | None = None
    """The frozen reference model's logprobs (the learner adds them; not packed)."""
    proximal_logprobs: hax.NamedArray | None = None
    """The proximal policy's logprobs (decoupled loss; the learner adds them; not packed)."""
    rewards: hax.NamedArray | None = None
    truncated: hax.NamedArray | None = None
    teacher_logprobs: hax.NamedArray | None = None
    teacher_top_ids: hax.NamedArray | None = None
    """Over `(batch, position, TEACHER_TOP_K)`, as `teacher_top_logprobs`."""
    teacher_top_logprobs: hax.NamedArray | None = None
    routed_experts: hax.NamedArray | None = None
    """Routing replay: over `(batch, position, routed_experts)` (`marin_rl.model.moe.ROUTED_EXPERTS`: layers × k)."""

    @staticmethod
    def from_packed(batch: PackedBatch, Batch: hax.Axis, Pos: hax.Axis) -> RlExample:
        """A host batch as named arrays on the default device (one explicit copy each, in its declared dtype; the
        caller shards). Every field of `TOKEN_FIELDS` that the batch has is carried; a batch with rewards but no
        `truncated` gets an all-false one."""
        fields = {}
        for f in TOKEN_FIELDS:
            x = getattr(batch, f.name)
            if x is None and f.name == "truncated" and batch.rewards is not None:
                x = np.zeros(batch.input_ids.shape, bool)
            if x is None:
                continue
            axes = (Batch, Pos, hax.Axis(f.trailing_axis, x.shape[-1])) if f.top_k else (Batch, Pos)
            fields[f.name] = hax.NamedArray(jax.device_put(np.asarray(x, dtype=f.dtype)), axes)
        return RlExample(**fields)


check_token_fields(RlExample)


def to_example(batch: PackedBatch) -> RlExample:
    """A host batch as an `RlExample` over `(batch, position)` on the default device (not yet sharded)."""
    Batch = hax.Axis("batch", batch.num_rows)
    Pos = hax.Axis("position", batch.seq_len)
    return RlExample.from_packed(batch, Batch, Pos)


_FIELDS = [f.name for f in dataclasses.fields(RlExample)]


def raw_fields(ex: RlExample) -> dict[str, jax.Array]:
    """The example's present fields as raw `(batch, position)` arrays (`(batch, position, k)` for a field with a
    trailing axis: the teacher's top-k, routed experts)."""
    out = {}
    for k in _FIELDS:
        field = getattr(ex, k)
        if field is not None:
            top = (_TRAILING_AXIS[k],) if k in _TRAILING_AXIS else ()
            out[k] = field.rearrange(("batch", "position", *top)).array
    return out


def from_raw(raw: dict[str, jax.Array]) -> RlExample:
    """The inverse of `raw_fields`: an example from raw `(batch, position[, k])` arrays."""
    rows, seq = raw["input_ids"].shape
    axes = (hax.Axis("batch", rows), hax.Axis("position", seq))

    def named(k, v):
        return hax.named(v, axes if v.ndim == 2 else (*axes, hax.Axis(_TRAILING_AXIS[k], v.shape[2])))

    return RlExample(**{k: named(k, v) for k, v in raw.items()})


def chunked(ex: RlExample, n: int) -> dict[str, jax.Array]:
    """Raw fields with the rows split into `n` consecutive chunks: arrays of shape `(n, rows / n, position, ...)`
    (the microbatches of `marin_rl.learner.step.microbatched`)."""
    return {k: v.reshape(n, v.shape[0] // n, *v.shape[1:]) for k, v in raw_fields(ex).items()}


def row_slice(ex: RlExample, start: int, stop: int) -> RlExample:
    """Rows `[start, stop)` of an example."""
    return from_raw({k: v[start:stop] for k, v in raw_fields(ex).items()})


def sampled_tokens(ex: RlExample) -> jax.Array:
    """Default weight of a microbatch chunk: its number of sampled (loss-masked) tokens."""
    return jnp.sum(ex.loss_mask.array.astype(jnp.float32))
