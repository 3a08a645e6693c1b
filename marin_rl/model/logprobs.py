"""Per-token logprobs (and entropies) of packed rows: one forward pass with a causal, segment-aware mask."""

from __future__ import annotations

import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from levanter.layers.attention import AttentionMask
from levanter.models.lm_model import LmHeadModel

from marin_rl.model.precision import cast_to_compute


def packed_attention_mask(segment_ids: hax.NamedArray) -> AttentionMask:
    """Causal mask that also blocks attention across segments (several rollouts per row)."""
    return AttentionMask.causal().with_segment_ids(segment_ids)


def token_logprobs(
    model: LmHeadModel,
    input_ids: hax.NamedArray,
    position_ids: hax.NamedArray,
    segment_ids: hax.NamedArray,
    *,
    temperature: float = 1.0,
    compute_dtype: str | None = None,
) -> tuple[hax.NamedArray, hax.NamedArray]:
    """Log-probability of each token given the previous tokens of its segment, and the entropy there.

    Returns arrays over the same axes as `input_ids`; the value at position t is about token t, computed from
    the logits at t-1 scaled by 1/temperature (as the sampler did). Position 0 of each row gets 0. `compute_dtype`
    ('bfloat16'): the forward pass in that dtype, the logits and everything after them in float32.
    """
    logits, log_z = _scaled_logits(model, input_ids, position_ids, segment_ids, temperature, compute_dtype)
    return _token_logprobs(model, input_ids, logits, log_z)


def token_logprobs_at(
    model: LmHeadModel,
    input_ids: hax.NamedArray,
    position_ids: hax.NamedArray,
    segment_ids: hax.NamedArray,
    candidate_ids: hax.NamedArray,
    *,
    temperature: float = 1.0,
    compute_dtype: str | None = None,
) -> tuple[hax.NamedArray, hax.NamedArray, hax.NamedArray]:
    """`token_logprobs`, and from the same forward pass the logprobs of other tokens at each position:
    `candidate_ids` over `(*input_ids.axes, K)`, whose value at position t names tokens that could stand at t (e.g.
    a teacher's top-k there); their logprobs under the distribution that predicts token t come back over the same
    axes (0 at position 0)."""
    logits, log_z = _scaled_logits(model, input_ids, position_ids, segment_ids, temperature, compute_dtype)
    lp, ent = _token_logprobs(model, input_ids, logits, log_z)
    Pos = input_ids.resolve_axis("position")
    shifted = jnp.roll(candidate_ids.array, -1, axis=candidate_ids.axes.index(Pos))  # at t-1: tokens that may be t
    picked = jnp.take_along_axis(logits.array, shifted, axis=-1) - log_z.array[..., None]
    picked = jnp.roll(picked, 1, axis=candidate_ids.axes.index(Pos))
    first = (jnp.arange(Pos.size) == 0)[:, None]
    return lp, ent, hax.named(jnp.where(first, 0.0, picked), candidate_ids.axes)


def top_k_logprobs(
    model: LmHeadModel,
    input_ids: hax.NamedArray,
    position_ids: hax.NamedArray,
    segment_ids: hax.NamedArray,
    k: int,
    *,
    temperature: float = 1.0,
    compute_dtype: str | None = None,
) -> tuple[hax.NamedArray, jnp.ndarray, jnp.ndarray]:
    """`token_logprobs`'s logprob of each token, and the k most likely tokens at each position with their logprobs
    (raw arrays `(*input_ids.shape, k)`, most likely first; the value at position t is the distribution that
    predicts token t, at `temperature`; 0 at position 0)."""
    logits, log_z = _scaled_logits(model, input_ids, position_ids, segment_ids, temperature, compute_dtype)
    lp, _ = _token_logprobs(model, input_ids, logits, log_z)
    top_logits, top_ids = jax.lax.top_k(logits.array, k)
    top_lps = top_logits - log_z.array[..., None]
    axis = input_ids.axes.index(input_ids.resolve_axis("position"))
    top_lps, top_ids = jnp.roll(top_lps, 1, axis=axis), jnp.roll(top_ids, 1, axis=axis)
    first = (jnp.arange(input_ids.array.shape[axis]) == 0)[:, None]
    return lp, jnp.where(first, 0, top_ids), jnp.where(first, 0.0, top_lps)


def _scaled_logits(model, input_ids, position_ids, segment_ids, temperature, compute_dtype):
    """Logits over `(*input_ids.axes, Vocab)` in float32 divided by `temperature`, and their log-normaliser; the
    forward pass in `compute_dtype` (`marin_rl.model.precision`; None: the parameters' own dtype)."""
    Vocab = model.Vocab
    model = cast_to_compute(model, compute_dtype)
    logits = model(input_ids, attn_mask=packed_attention_mask(segment_ids), pos_ids=position_ids)
    logits = logits.astype(jnp.float32).rearrange((*input_ids.axes, Vocab))
    if temperature != 1.0:
        logits = logits / temperature
    return logits, hnn.logsumexp(logits, axis=Vocab)


def _token_logprobs(model, input_ids, logits, log_z):
    # One pass over the vocabulary for the normaliser and one for the entropy; no (tokens × vocab) log-softmax is
    # materialised: log p(token) = logit[token] - log Z and H = log Z - Σ_v p_v·logit_v.
    Pos = input_ids.resolve_axis("position")
    Vocab = model.Vocab
    # logits[t-1] predict token t: shift targets left by one.
    next_ids = hax.roll(input_ids, -1, Pos)
    target_logit = jnp.take_along_axis(logits.array, next_ids.array[..., None], axis=-1)[..., 0]
    target_lp = hax.named(target_logit, input_ids.axes) - log_z  # value at t-1 is about token t
    entropy = log_z - hax.sum(hax.exp(logits - log_z) * logits, axis=Vocab)
    lp = hax.roll(target_lp, 1, Pos)
    ent = hax.roll(entropy, 1, Pos)
    first = hax.arange(Pos) == 0
    return hax.where(first, 0.0, lp), hax.where(first, 0.0, ent)
