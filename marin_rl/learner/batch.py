"""The learner's training batch on its devices: `RlExample`, a packed batch of haliax named arrays.

The replay side packs rollouts into a host `PackedBatch` of NumPy arrays (`marin_rl.types`); `RlExample.from_packed`
puts one on the devices, where the losses (`marin_rl.learner.losses`) read it.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import numpy as np

from marin_rl.types import PackedBatch

TEACHER_TOP_K = "teacher_top_k"
"""Name of the axis of the teacher's top-k tokens in `RlExample.teacher_top_ids` / `teacher_top_logprobs`."""


class RlExample(eqx.Module):
    """A packed training batch of named arrays over `(batch, position)`.

    `sampler_logprobs[b, t]` is the sampler's log-probability of `input_ids[b, t]`; `loss_mask` is true only on
    tokens that the policy sampled. Several rollouts share a row, separated by `segment_ids`.
    """

    input_ids: hax.NamedArray
    position_ids: hax.NamedArray
    segment_ids: hax.NamedArray
    loss_mask: hax.NamedArray
    advantages: hax.NamedArray
    sampler_logprobs: hax.NamedArray
    token_versions: hax.NamedArray
    reference_logprobs: hax.NamedArray | None = None
    proximal_logprobs: hax.NamedArray | None = None
    rewards: hax.NamedArray | None = None
    """Per-token rewards (`PackedBatch.rewards`), for a critic's GAE on the device; None without them."""
    truncated: hax.NamedArray | None = None
    """With `rewards`: true on every token of an episode cut off by a length limit."""
    teacher_logprobs: hax.NamedArray | None = None
    """A teacher's logprob of each sampled token (`PackedBatch.teacher_logprobs`); None without a teacher."""
    teacher_top_ids: hax.NamedArray | None = None
    """Top-k distillation: the teacher's top-k token ids over `(batch, position, TEACHER_TOP_K)`; None without."""
    teacher_top_logprobs: hax.NamedArray | None = None
    """The teacher's logprobs of `teacher_top_ids`, over the same axes; None without."""

    @staticmethod
    def from_packed(batch: PackedBatch, Batch: hax.Axis, Pos: hax.Axis) -> RlExample:
        """A host batch as named arrays on the default device (one explicit copy each; the caller shards)."""

        def named(x, dtype):
            return hax.NamedArray(jax.device_put(np.asarray(x, dtype=dtype)), (Batch, Pos))

        def named_top(x, dtype):
            if x is None:
                return None
            TopK = hax.Axis(TEACHER_TOP_K, x.shape[-1])
            return hax.NamedArray(jax.device_put(np.asarray(x, dtype=dtype)), (Batch, Pos, TopK))

        return RlExample(
            input_ids=named(batch.input_ids, np.int32),
            position_ids=named(batch.position_ids, np.int32),
            segment_ids=named(batch.segment_ids, np.int32),
            loss_mask=named(batch.loss_mask, np.bool_),
            advantages=named(batch.advantages, np.float32),
            sampler_logprobs=named(batch.sampler_logprobs, np.float32),
            token_versions=named(batch.token_versions, np.int32),
            rewards=None if batch.rewards is None else named(batch.rewards, np.float32),
            truncated=None if batch.rewards is None else named(_truncated(batch), np.bool_),
            teacher_logprobs=None if batch.teacher_logprobs is None else named(batch.teacher_logprobs, np.float32),
            teacher_top_ids=named_top(batch.teacher_top_ids, np.int32),
            teacher_top_logprobs=named_top(batch.teacher_top_logprobs, np.float32),
        )


def _truncated(batch: PackedBatch) -> np.ndarray:
    """`batch.truncated`, or all false when the batch does not say."""
    return np.zeros(batch.input_ids.shape, bool) if batch.truncated is None else batch.truncated
