"""Mixture-of-experts routing that the sampler records and the learner replays (routing replay).

An expert layer sends each token to the k experts its router scores highest. The sampler and the learner compute the
router's scores from hidden states that differ in the last bits (another batch shape, another kernel, bfloat16), so
where two experts nearly tie they may choose differently for the same token, and their logprobs of it then differ by
far more than numerics. Routing replay removes that: the sampler records, per token and expert layer, the experts it
chose (`moe_forward` returns them), the rollout carries them to the packed batch (`ROUTED_EXPERTS`, layer-major:
`[layer 0's k, layer 1's k, ...]` per token, -1 where none was recorded), and the learner's forward routes each token
to exactly those experts (`with_replayed_routing`). The gates of the replayed experts are still the router's own
probabilities (softmax over all experts, taken at the replayed indices and renormalised as the family does), so the
router keeps its gradient.

`moe_forward` is Levanter's sparse block (Qwen3-MoE's `Qwen3MoeSparseMoeBlock`, Mixtral's `MixtralSparseMoeBlock`)
step for step: its router, its token permutation, its grouped expert matmuls (the block's own methods), with the
top-k choice exposed and overridable; without replayed experts it computes what the block computes.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import NamedArray
from levanter.models.lm_model import LmHeadModel
from levanter.models.mixtral import MixtralDecoderLayer, MixtralSparseMoeBlock
from levanter.models.qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeSparseMoeBlock

ROUTED_EXPERTS = "routed_experts"
"""Name of the axis of a token's recorded experts: `layers × k` entries, layer-major."""

MOE_LAYERS = (MixtralDecoderLayer, Qwen3MoeDecoderLayer)
"""Levanter's decoder layers whose MLP is a mixture of experts."""

ROUTE_DTYPE = jnp.int16
"""Element type of recorded expert indices on the devices and in a packed batch (`marin_rl.types.TOKEN_FIELDS`'s
`routed_experts`): experts number fewer than 32,768."""

NO_EXPERT = -1
"""A recorded expert index meaning "none recorded here": the learner routes that token itself."""


def sparse_block(layer) -> Qwen3MoeSparseMoeBlock | MixtralSparseMoeBlock:
    """The sparse (routed) block of an expert layer: Mixtral's `block_sparse_moe`, Qwen3-MoE's `mlp`."""
    return layer.block_sparse_moe if isinstance(layer, MixtralDecoderLayer) else layer.mlp


def routes_experts(model: LmHeadModel) -> bool:
    """Whether `model`'s decoder layers are mixtures of experts (Mixtral, Qwen3-MoE)."""
    return isinstance(model.transformer.layers.unstacked()[0], MOE_LAYERS)


def routing_shape(model: LmHeadModel) -> tuple[int, int] | None:
    """(expert layers, experts per token) of a mixture-of-experts model; None for a dense one."""
    if not routes_experts(model):
        return None
    config = model.transformer.config
    return int(config.num_layers), int(config.num_experts_per_tok)


def moe_forward(
    block: Qwen3MoeSparseMoeBlock | MixtralSparseMoeBlock, x: NamedArray, experts: NamedArray | None = None
) -> tuple[NamedArray, NamedArray, dict]:
    """The sparse block on `x` [..., embed] (its token axes: `batch` and the block's position axis, or the position
    axis alone): returns (output like `x`, the experts each token went to [..., top_experts] int32, the block's
    router statistics: Mixtral's `expert_loads` and auxiliary losses, empty for Qwen3-MoE).

    `experts` [..., top_experts] (the same token axes), when given, routes each token to those experts instead of the
    router's top k, except where an entry is `NO_EXPERT` (there the router's own choice stands); the gates are the
    router's probabilities at the chosen experts, renormalised over the k as the block does. Must run under a device
    mesh (the block permutes tokens in shard_maps)."""
    config = block.config
    Pos = config.max_Pos.name
    squash = [x.resolve_axis("batch"), x.resolve_axis(Pos)] if x.has_axis("batch") else [x.resolve_axis(Pos)]
    Experts, TopExperts = config.Experts, config.TopExperts
    x_flat = hax.flatten_axes(x, old_axes=squash, new_axis="token")
    Token = x_flat.resolve_axis("token")
    router_logits = block.gate(x_flat, key=None)
    mixtral = isinstance(block, MixtralSparseMoeBlock)
    # Mixtral's softmax runs in the activations' dtype, Qwen3-MoE's in float32 (as Levanter's blocks do)
    probs = hnn.softmax(router_logits if mixtral else router_logits.astype(jnp.float32), axis=Experts)
    probs = probs.rearrange((Token, Experts))
    top_weights, top_idx = jax.lax.top_k(probs.array, TopExperts.size)
    if experts is not None:
        forced = hax.flatten_axes(experts, old_axes=squash, new_axis="token").rearrange((Token, TopExperts)).array
        top_idx = jnp.where(forced >= 0, forced.astype(top_idx.dtype), top_idx)
        top_weights = jnp.take_along_axis(probs.array, top_idx, axis=-1)
    if mixtral or config.norm_topk_prob:
        top_weights = top_weights / top_weights.sum(-1, keepdims=True)
    topk_weights = hax.named(top_weights, (Token, TopExperts)).astype(x.dtype)
    topk_idx = hax.named(top_idx, (Token, TopExperts))
    topk_idx_flat = hax.flatten_axes(topk_idx, old_axes=[Token, TopExperts], new_axis="token_repeat")
    TokenRepeat = topk_idx_flat.resolve_axis("token_repeat")
    x_repeat_sort, group_sizes, sort_idx = block._permute(x_flat, topk_idx_flat, TokenRepeat)
    out_repeat_sort = block.experts(x_repeat_sort, group_sizes, key=None)
    if mixtral:
        out_repeat = block._unpermute(out_repeat_sort, sort_idx, topk_weights, Token, TokenRepeat, TopExperts)
    else:
        out_repeat = block._unpermute(out_repeat_sort, sort_idx, Token, TopExperts)
    out = out_repeat.dot(topk_weights, axis=TopExperts)
    extras = _router_statistics(block, router_logits, probs, group_sizes, Token) if mixtral else {}
    chosen = hax.unflatten_axis(topk_idx, axis=Token, new_axes=squash)
    return hax.unflatten_axis(out, axis=Token, new_axes=squash), chosen, extras


def _router_statistics(block: MixtralSparseMoeBlock, router_logits, probs, group_sizes, Token) -> dict:
    """Mixtral's router statistics, as its block returns them (expert loads, and the load-balancing and z losses
    when configured)."""
    config = block.config
    Experts = config.Experts
    expert_loads = group_sizes / hax.sum(group_sizes, axis=Experts)
    extras = {"expert_loads": expert_loads}
    if config.lbl_coef is not None:
        f = expert_loads * config.n_routed_experts / config.num_experts_per_tok
        extras["load_balancing_loss"] = config.lbl_coef * hax.sum(f * hax.mean(probs, axis=Token), axis=Experts)
    if config.rzl_coef is not None:
        extras["router_z_loss"] = config.rzl_coef * hax.mean(
            hnn.logsumexp(router_logits, axis=Experts) ** 2, axis=Token
        )
    return extras


class ReplayedRouting(eqx.Module):
    """A sparse block that routes by recorded experts (`moe_forward` with `experts`); stands in for the block inside a
    decoder layer, with the block's call signature and return value."""

    block: Qwen3MoeSparseMoeBlock | MixtralSparseMoeBlock
    """Levanter's sparse block (its parameters are the model's, trained as usual)."""
    experts: NamedArray
    """The experts of each token [batch, position, top_experts] (with a `layers` axis while the layers are stacked:
    the layer scan hands each layer its slice); `NO_EXPERT` where the router chooses."""

    def __call__(self, x: NamedArray, *, key=None):
        out, _, extras = moe_forward(self.block, x, self.experts)
        return (out, extras) if isinstance(self.block, MixtralSparseMoeBlock) else out


def with_replayed_routing(model: LmHeadModel, routed: NamedArray) -> LmHeadModel:
    """`model` whose expert layers route every token by `routed` [batch, position, ROUTED_EXPERTS] (layer-major,
    `NO_EXPERT` where the model routes the token itself; a packed batch's `routed_experts`). The parameters are
    `model`'s own: gradients flow to them, the router's through the replayed experts' gates. ValueError when
    `routed`'s width is not the model's layers × k."""
    shape = routing_shape(model)
    if shape is None:
        raise ValueError(f"{type(model).__name__} has no expert layers to replay routing in")
    layers, k = shape
    width = routed.resolve_axis(ROUTED_EXPERTS).size
    if width != layers * k:
        raise ValueError(
            f"routed experts of width {width} for a model of {layers} expert layers × {k} experts per token "
            f"({layers * k}): the rollouts were sampled from another architecture"
        )
    Layers = model.transformer.config.Layers
    TopExperts = model.transformer.config.TopExperts
    Pos = model.transformer.config.max_Pos.name
    token_axes = tuple(a for a in routed.axes if a.name != ROUTED_EXPERTS)
    per_layer = routed.unflatten_axis(ROUTED_EXPERTS, (Layers, TopExperts)).rearrange((Layers, *token_axes, TopExperts))
    if token_axes[-1].name != Pos:  # the block flattens (batch, its position axis)
        per_layer = per_layer.rename({token_axes[-1].name: Pos})
    stack = model.transformer.layers
    if hasattr(stack, "stacked"):  # one stacked layer: the scan slices the experts' `layers` axis per layer
        replaced = ReplayedRouting(sparse_block(stack.stacked), per_layer)
        return eqx.tree_at(lambda m: sparse_block(m.transformer.layers.stacked), model, replaced)
    blocks = stack.blocks
    return eqx.tree_at(
        lambda m: [sparse_block(b) for b in m.transformer.layers.blocks],
        model,
        [ReplayedRouting(sparse_block(b), per_layer[Layers.name, i]) for i, b in enumerate(blocks)],
    )
