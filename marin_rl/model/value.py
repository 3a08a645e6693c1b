"""The critic's model: a Levanter LM's trunk with a scalar value head, and per-token values of packed rows.

A `ValueModel` is a trunk and a value head, a linear map from the trunk's last hidden state to one number, initialised
to zero, so a new critic predicts 0 everywhere and the first advantages are the rewards to go. The trunk is either a
copy of a language model without its LM head, with weights of its own (`value_model_from`), or the policy itself,
read through a stop-gradient so that the value loss trains only the head (`head_on`).
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from levanter.models.lm_model import LmHeadModel

from marin_rl.model.logprobs import packed_attention_mask
from marin_rl.model.precision import cast_to_compute

ValueOut = hax.Axis("value", 1)


class ValueModel(eqx.Module):
    """V(s) for every prefix of a token sequence: `trunk.activations` then `head` (Embed → one value)."""

    trunk: LmHeadModel
    """A language model whose `activations` give the hidden states (its LM head is dropped)."""
    head: hnn.Linear
    """Embed → `value` (size 1)."""

    def hidden_values(
        self, input_ids: hax.NamedArray, position_ids: hax.NamedArray, segment_ids: hax.NamedArray
    ) -> hax.NamedArray:
        """The value of the state after each token: position t holds V(tokens ≤ t of its segment), over the same
        axes as `input_ids` (float32)."""
        h = self.trunk.activations(input_ids, attn_mask=packed_attention_mask(segment_ids), pos_ids=position_ids)
        return self.head(h).astype(jnp.float32)["value", 0]


def zero_value_head(model: LmHeadModel) -> hnn.Linear:
    """A value head for `model`'s hidden states (Embed → one value), all zeros: it predicts 0 everywhere."""
    Embed = model.embeddings.Embed if hasattr(model, "embeddings") else model.config.Embed
    head = hnn.Linear.init(In=Embed, Out=ValueOut, key=jax.random.PRNGKey(0), use_bias=True)
    return jax.tree_util.tree_map(jnp.zeros_like, head)


def value_model_from(policy: LmHeadModel) -> ValueModel:
    """A critic whose trunk is a copy of `policy`'s (LM head dropped) and whose value head is zero."""
    trunk = jax.tree_util.tree_map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, policy, is_leaf=eqx.is_array)
    if getattr(trunk, "lm_head", None) is not None:
        trunk = eqx.tree_at(lambda m: m.lm_head, trunk, None, is_leaf=lambda x: x is None)
    return ValueModel(trunk, zero_value_head(trunk))


def head_on(trunk: LmHeadModel, head: hnn.Linear) -> ValueModel:
    """A value model reading the hidden states of `trunk` (e.g. the policy itself) without training it: gradients of
    the value loss stop at the trunk's output and reach only `head`."""
    return ValueModel(jax.lax.stop_gradient(trunk), head)


def token_values(
    model: ValueModel,
    input_ids: hax.NamedArray,
    position_ids: hax.NamedArray,
    segment_ids: hax.NamedArray,
    compute_dtype: str | None = None,
) -> tuple[hax.NamedArray, hax.NamedArray]:
    """(values, after): `values[t]` = V(state before token t) = the value after token t-1, aligned like the
    learner's logprobs (0 at each row's first position); `after[t]` = V(state after token t), which at an episode's
    last position is its bootstrap value when it was truncated. The forward pass in `compute_dtype`
    (`marin_rl.model.precision`), the values in float32."""
    model = cast_to_compute(model, compute_dtype)
    after = model.hidden_values(input_ids, position_ids, segment_ids).astype(jnp.float32)
    Pos = input_ids.resolve_axis("position")
    first = hax.arange(Pos) == 0
    return hax.where(first, 0.0, hax.roll(after, 1, Pos)), after
