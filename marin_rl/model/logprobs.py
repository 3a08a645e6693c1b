"""Per-token logprobs (and entropies) of packed rows: one forward pass with a causal, segment-aware mask."""

from __future__ import annotations

import haliax as hax
import haliax.nn as hnn
import jax.numpy as jnp
from levanter.layers.attention import AttentionMask
from levanter.models.lm_model import LmHeadModel


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
) -> tuple[hax.NamedArray, hax.NamedArray]:
    """Log-probability of each token given the previous tokens of its segment, and the entropy there.

    Returns arrays over the same axes as `input_ids`; the value at position t is about token t, computed from
    the logits at t-1 scaled by 1/temperature (as the sampler did). Position 0 of each row gets 0.
    """
    Pos = input_ids.resolve_axis("position")
    Vocab = model.Vocab
    logits = model(input_ids, attn_mask=packed_attention_mask(segment_ids), pos_ids=position_ids)
    logits = logits.astype(jnp.float32).rearrange((*input_ids.axes, Vocab))
    if temperature != 1.0:
        logits = logits / temperature
    # One pass over the vocabulary for the normaliser and one for the entropy; no (tokens × vocab) log-softmax is
    # materialised: log p(token) = logit[token] - log Z and H = log Z - Σ_v p_v·logit_v.
    log_z = hnn.logsumexp(logits, axis=Vocab)
    # logits[t-1] predict token t: shift targets left by one.
    next_ids = hax.roll(input_ids, -1, Pos)
    target_logit = jnp.take_along_axis(logits.array, next_ids.array[..., None], axis=-1)[..., 0]
    target_lp = hax.named(target_logit, input_ids.axes) - log_z  # value at t-1 is about token t
    entropy = log_z - hax.sum(hax.exp(logits - log_z) * logits, axis=Vocab)
    lp = hax.roll(target_lp, 1, Pos)
    ent = hax.roll(entropy, 1, Pos)
    first = hax.arange(Pos) == 0
    return hax.where(first, 0.0, lp), hax.where(first, 0.0, ent)
