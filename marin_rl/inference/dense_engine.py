"""A dense-cache sampler for the embedded server that batches continuously: slots of a dense KV cache, prompts
prefilled together (a group's samples share their prompt's prefill), every live slot decoded in compiled chunks, and a
slot whose sequence finishes refilled with a waiting one.

Levanter's engine (`levanter.inference.engine`) serves from a paged KV cache with a scheduler that admits, prefills,
decodes and retires sequences in many small device programs; on a TPU its kernels make that fast. On a CPU, and for
the Llama-family models RL trains, the bookkeeping and the reference attention (one sequence and one query token at a
time) cost more than the model.

`DenseEngine.run` holds up to `max_seqs` sequences at once in slots of a dense cache (positions per slot: as many as
the call's sequences can reach, rounded up to a power of two, at most `max_seq_len`; keys [slot, kv_head,
head_size, position], values [slot, kv_head, position, head_size], per layer):

- **admission**: waiting sequences take free slots; their distinct prompts are prefilled in one forward over
  [prompts, positions] (causal attention over each prompt, at most `prefill_tokens` prompt tokens per call), each
  prompt's keys and values are copied into every slot that samples from it (the n samples of a request, a group), and
  each slot samples its first token from its prompt's last logits;
- **decoding**: one compiled loop feeds every slot its last token at its own position, writes the key and value there,
  and samples the next, for up to `decode_steps` steps (to the end when nothing waits);
- **retirement**: after each chunk the host reads which slots have finished (a stop sequence, their token limit) and
  frees them for waiting sequences.

So a batch of sequences whose lengths differ costs the sum of their lengths, not the longest times the count, and
requests beyond `max_seqs` need no second engine call.

Sampling is Levanter's: the same sampler module, and per token the key `fold_in(key(seed), position)` of the position
whose logits are sampled, as the paged engine derives it, so a seeded request's samples do not depend on which other
requests share its batch, and a generation continued in segments samples what one pass would (up to the last bits of
a prefilled key against a decoded one). Supported models (`check_supported`) are Levanter's Llama family (Llama,
Mistral, Qwen2, Qwen3: `LlamaDecoderLayer`s and `QwenDecoderLayer`s) and its mixtures of experts (Qwen3-MoE,
Mixtral: `Qwen3MoeDecoderLayer`s and `MixtralDecoderLayer`s), all with plain multi-head attention; `DenseEngine`
raises ValueError for others. An expert layer runs Levanter's own sparse block (the learner's code: the same router,
top-k and grouped matmuls) on the [slot, position] tokens of a prefill or a decode step, under the mesh the model's
arrays live on (Levanter routes in a shard_map). Each token's experts follow from its own hidden state (no capacity
limit drops a token for others), but routing is a top-k, so a near-tie can fall either way between the engine and the
learner when their last bits differ (not seen in float32 on the test checkpoints; in bfloat16 it is common,
`benchmarks/RESULTS.md`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from levanter.inference.engine import GenerationResult, Request
from levanter.inference.utils import INVALID
from levanter.layers.attention import Attention
from levanter.layers.sampler import Sampler
from levanter.models.llama import LlamaDecoderLayer
from levanter.models.lm_model import LmHeadModel
from levanter.models.mixtral import MixtralDecoderLayer
from levanter.models.qwen import QwenDecoderLayer
from levanter.models.qwen3_moe import Qwen3MoeDecoderLayer

from marin_rl.model.moe import (
    MOE_LAYERS,
    NO_EXPERT,
    ROUTE_DTYPE,
    moe_forward,
    routes_experts,
    routing_shape,
    sparse_block,
)


@dataclass(frozen=True)
class DenseDecodeParams:
    """A sequence's decoding parameters as `DenseEngine` reads them: the fields of Levanter's `SeqDecodingParams`
    (which it also accepts), in a plain record that is cheap to build per sequence."""

    max_num_tokens: np.int32
    """Tokens in all, prompt included."""
    stop_tokens: hax.NamedArray | None
    """[stop_seq, position] stop sequences, left padded with INVALID (None: none)."""
    temperature: np.float32
    """Sampling temperature (0: greedy)."""
    top_p: np.float32
    """Unused by the dense engine (it samples the whole distribution)."""
    key: np.ndarray
    """The sequence's PRNG key data ([0, seed])."""


BATCH_BUCKETS = (16, 64, 256)
"""Row counts a batch is padded to (each compiles once; capped at `max_seqs`, which is always one)."""


FAMILIES = "Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and Mixtral"
"""The model families `DenseEngine` decodes, as its refusals name them."""


def check_supported(model: LmHeadModel) -> None:
    """Raise ValueError unless `DenseEngine` can decode `model`: a Levanter model of Llama's, Qwen2's, Qwen3-MoE's or
    Mixtral's decoder layers with plain multi-head attention (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral;
    checked against the learner per family in tests/test_hf_families.py)."""
    transformer = getattr(model, "transformer", None)
    layers = getattr(transformer, "layers", None)
    if layers is None or not hasattr(layers, "unstacked"):
        raise ValueError(
            f"the dense engine decodes {FAMILIES} models; {type(model).__name__} has no layer stack "
            "(use inference.backend: vllm)"
        )
    layer = layers.unstacked()[0]
    if getattr(layer.config, "use_sliding_window", False):  # Qwen2, Qwen3, Qwen3-MoE
        raise ValueError("the dense engine has no sliding-window attention (use inference.levanter.engine: paged)")
    # Qwen2's layer is Llama's without extra norms; Qwen3 uses Llama's (qk-norm in its attention)
    if not isinstance(layer, LlamaDecoderLayer | QwenDecoderLayer | MixtralDecoderLayer | Qwen3MoeDecoderLayer):
        raise ValueError(
            f"the dense engine decodes {FAMILIES} models (their decoder layer stacks), not "
            f"{type(model).__name__} ({type(layer).__name__} layers); use inference.backend: vllm"
        )
    attn = layer.self_attn
    if type(attn) is not Attention:
        raise ValueError(
            f"the dense engine supports plain multi-head attention, not {type(attn).__name__} "
            "(use inference.levanter.engine: paged)"
        )
    if getattr(attn.config, "sliding_window", None) is not None:
        raise ValueError("the dense engine has no sliding-window attention (use inference.levanter.engine: paged)")


def expert_mesh(model: LmHeadModel) -> jax.sharding.Mesh:
    """The device mesh under which `DenseEngine` runs a mixture-of-experts model (Levanter routes its tokens in a
    shard_map, which needs one): the mesh the model's arrays are laid out on (a colocated learner's), or else a
    one-device mesh on the device holding them."""
    leaf = next(x for x in jax.tree_util.tree_leaves(model) if isinstance(x, jax.Array))
    sharding = leaf.sharding
    if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(sharding.mesh, jax.sharding.Mesh):
        return sharding.mesh
    return jax.sharding.Mesh(np.array(sorted(sharding.device_set, key=lambda d: d.id)[:1]), ("data",))


def _attention_scale(attn: Attention) -> float:
    cfg = attn.config
    return cfg.scaling_factor if cfg.scaling_factor is not None else 1.0 / math.sqrt(cfg.HeadSize.size)


def _soft_cap(attn: Attention, scores: jnp.ndarray) -> jnp.ndarray:
    cap = attn.config.logits_soft_cap
    return scores if cap is None else jnp.tanh(scores / cap) * cap


def _rest_of_layer(layer, residual: hax.NamedArray, out: jnp.ndarray, axes: tuple[str, ...]):
    """The layer after attention: output projection, residual, MLP or mixture of experts (`out` [batch, position,
    kv_head, group, head_size] as a plain array named by `axes`). Returns the layer's output and, for an expert
    layer, the experts each [batch, position] token went to ([batch, position, k], `marin_rl.model.moe.moe_forward`:
    each token is routed on its own, so prefill (whole prompts) and decode (one position per slot) route alike), else
    None."""
    attn: Attention = layer.self_attn
    out = hax.named(out, axes).flatten_axes(("kv_head", "q_heads_per_group"), "heads").astype(residual.dtype)
    attn_output = attn.o_proj(out, key=None)
    if getattr(layer, "post_attn_layernorm", None) is not None:
        attn_output = layer.post_attn_layernorm(attn_output)
    x = residual + attn_output
    residual = x
    x = layer.post_attention_layernorm(x)
    if not isinstance(layer, MOE_LAYERS):
        mlp_output, experts = layer.mlp(x, key=None), None
    else:  # (the router statistics moe_forward also returns are for the aux losses)
        routed, chosen, _ = moe_forward(sparse_block(layer), x)
        experts = chosen.rearrange(("batch", "position", "top_experts")).array
        if isinstance(layer, MixtralDecoderLayer):  # shared experts (if any) and routed ones, summed as the layer does
            shared = layer.shared_mlp(x, key=None) if layer.shared_mlp is not None else 0
            return residual + shared + routed, experts
        mlp_output = routed
    if getattr(layer, "post_mlp_layernorm", None) is not None:
        mlp_output = layer.post_mlp_layernorm(mlp_output)
    return residual + mlp_output, experts


_OUT_AXES = ("batch", "position", "kv_head", "q_heads_per_group", "head_size")


def _layer_prefill(layer, x: hax.NamedArray, pos_ids: hax.NamedArray, cache_dtype):
    """One decoder layer over whole prompts (`x` [batch, position, embed], causal attention); returns its output,
    the prompts' keys [batch, kv_head, head_size, position] and values [batch, kv_head, position, head_size], and an
    expert layer's routing ([batch, position, k], else None)."""
    attn: Attention = layer.self_attn
    q, k, v = attn._compute_qkv(layer.input_layernorm(x), key=None, pos_ids=pos_ids)
    keys = k.rearrange(("batch", "kv_head", "head_size", "position")).array.astype(cache_dtype)
    values = v.rearrange(("batch", "kv_head", "position", "head_size")).array.astype(cache_dtype)
    qa = q.rearrange(("batch", "kv_head", "q_heads_per_group", "position", "head_size")).array
    scores = jnp.einsum(
        "bhgqd,bhdk->bhgqk", (qa * _attention_scale(attn)).astype(jnp.float32), keys.astype(jnp.float32)
    )
    scores = _soft_cap(attn, scores)
    positions = qa.shape[3]
    causal = jnp.arange(positions)[None, :] <= jnp.arange(positions)[:, None]
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhgqk,bhkd->bqhgd", weights, values.astype(jnp.float32))
    y, experts = _rest_of_layer(layer, x, out, _OUT_AXES)
    return y, (keys, values), experts


def _layer_decode(layer, x: hax.NamedArray, cache, pos: jnp.ndarray, pos_ids: hax.NamedArray):
    """One decoder layer on one token per slot (`x` [batch, position=1, embed]) at each slot's position `pos`,
    writing its key and value into the slot's cache there and attending to the slot's positions up to it; mirrors
    `LlamaDecoderLayer.decode` with `Attention.paged_decode`. Returns the output, the cache, and an expert layer's
    routing ([batch, 1, k], else None)."""
    keys, values = cache
    attn: Attention = layer.self_attn
    q, k, v = attn._compute_qkv(layer.input_layernorm(x), key=None, pos_ids=pos_ids)
    rows = jnp.arange(keys.shape[0])
    new_k = k.rearrange(("batch", "kv_head", "head_size", "position")).array[..., 0].astype(keys.dtype)
    new_v = v.rearrange(("batch", "kv_head", "head_size", "position")).array[..., 0].astype(values.dtype)
    keys = keys.at[rows, :, :, pos].set(new_k)
    values = values.at[rows, :, pos, :].set(new_v)
    qa = q.rearrange(("batch", "kv_head", "q_heads_per_group", "head_size", "position")).array[..., 0]
    scores = jnp.einsum("bhgd,bhds->bhgs", (qa * _attention_scale(attn)).astype(jnp.float32), keys.astype(jnp.float32))
    scores = _soft_cap(attn, scores)
    visible = jnp.arange(keys.shape[-1])[None, :] <= pos[:, None]  # [slot, position]
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgs,bhsd->bhgd", weights, values.astype(jnp.float32))
    y, experts = _rest_of_layer(layer, x, out[:, None], _OUT_AXES)
    return y, (keys, values), experts


def _head(model: LmHeadModel, x: hax.NamedArray) -> hax.NamedArray:
    """Logits of final hidden states `x` (the model's norm, then its head or tied embeddings)."""
    x = model.transformer.norm(x)
    return model.lm_head(x, key=None) if model.lm_head is not None else model.embeddings.unembed(x)


def _ends_with_stop(tokens: jnp.ndarray, end: jnp.ndarray, stops: jnp.ndarray) -> jnp.ndarray:
    """Per row: whether tokens[r, :end[r] + 1] ends with one of the row's stop sequences (`stops` [batch, K, L], left
    padded with INVALID; an all-INVALID sequence never matches)."""
    length = stops.shape[-1]
    idx = end[:, None] - length + 1 + jnp.arange(length)[None, :]  # positions end-L+1 .. end
    window = jnp.where(idx >= 0, jnp.take_along_axis(tokens, jnp.maximum(idx, 0), axis=1), INVALID)
    used = stops != INVALID
    match = jnp.all(~used | (window[:, None, :] == stops), axis=-1) & jnp.any(used, axis=-1)
    return jnp.any(match, axis=-1)


class _Slots(eqx.Module):
    """The device state of the slots: every layer's cache and each slot's sequence and decoding parameters."""

    caches: list
    tokens: jnp.ndarray  # [slot, S] prompt and sampled tokens
    logprobs: jnp.ndarray  # [slot, S] the sampled tokens' logprobs (0 elsewhere)
    pos: jnp.ndarray  # [slot] position of the slot's last token (fed at its next decode step)
    limits: jnp.ndarray  # [slot] tokens in all (prompt included) at which the slot stops
    temperatures: jnp.ndarray
    keys: jnp.ndarray  # [slot, 2] PRNG key data
    stops: jnp.ndarray  # [slot, K, L]
    done: jnp.ndarray  # [slot] finished or empty
    routes: jnp.ndarray | None  # [slot, S, layers × k] a mixture of experts' routing of each fed token (-1: none)


def _empty_slots(
    model: LmHeadModel, slots: int, positions: int, stops_shape: tuple[int, int], cache_dtype, record_routing: bool
) -> _Slots:
    cfg = model.transformer.layers.unstacked()[0].self_attn.config
    shape = routing_shape(model) if record_routing else None
    heads, head_size = cfg.KVHeads.size, cfg.HeadSize.size
    caches = [
        (
            jnp.zeros((slots, heads, head_size, positions), cache_dtype),
            jnp.zeros((slots, heads, positions, head_size), cache_dtype),
        )
        for _ in model.transformer.layers.unstacked()
    ]
    return _Slots(
        caches=caches,
        tokens=jnp.zeros((slots, positions), jnp.int32),
        logprobs=jnp.zeros((slots, positions), jnp.float32),
        pos=jnp.zeros((slots,), jnp.int32),
        limits=jnp.ones((slots,), jnp.int32),
        temperatures=jnp.ones((slots,), jnp.float32),
        keys=jnp.zeros((slots, 2), jnp.uint32),
        stops=jnp.full((slots, *stops_shape), INVALID, jnp.int32),
        done=jnp.ones((slots,), bool),
        routes=None if shape is None else jnp.full((slots, positions, shape[0] * shape[1]), NO_EXPERT, ROUTE_DTYPE),
    )


def _sample(sampler: Sampler, logits: hax.NamedArray, temperatures, keys, positions):
    """Each row's token and logprob from its logits at its temperature, with the key of the sampled position's
    logits (`fold_in(key, position)`)."""
    step_keys = jax.vmap(jax.random.fold_in)(keys, positions)
    # top_ps=None: the whole distribution at the row's temperature (no nucleus filter to compute)
    new, lp = hax.vmap(sampler, "batch")(logits, hax.named(temperatures, "batch"), top_ps=None, key=step_keys)
    return new.array, lp.array


def _admit(model, sampler: Sampler, state: _Slots, prompts, lengths, source, slot, limits, temperatures, keys, stops):
    """Prefill `prompts` [U, P] (their first `lengths` tokens real) and start the rows that sample from them: row i
    reads prompt `source[i]` into slot `slot[i]` (a slot index past the last: padding, dropped) and samples its first
    token."""
    cache_dtype = state.caches[0][0].dtype
    ids = hax.named(prompts, ("batch", "position"))
    pos_ids = hax.named(jnp.broadcast_to(jnp.arange(prompts.shape[1]), prompts.shape), ("batch", "position"))
    x = model.embeddings.embed(ids)
    caches = []
    experts = []
    for layer, (keys_cache, values_cache) in zip(model.transformer.layers.unstacked(), state.caches, strict=True):
        x, (k, v), chosen = _layer_prefill(layer, x, pos_ids, cache_dtype)
        width = k.shape[-1]
        keys_cache = keys_cache.at[slot, :, :, :width].set(k[source], mode="drop")
        values_cache = values_cache.at[slot, :, :width, :].set(v[source], mode="drop")
        caches.append((keys_cache, values_cache))
        experts.append(chosen)
    last = lengths - 1
    hidden = x.array[jnp.arange(x.array.shape[0]), last]  # [U, embed] each prompt's last position
    logits = _head(model, hax.named(hidden[source], ("batch", x.axes[-1].name)))
    row_last = last[source]
    new, lp = _sample(sampler, logits, temperatures, keys, row_last)
    positions = state.tokens.shape[1]
    rows = jnp.pad(prompts[source], ((0, 0), (0, positions - prompts.shape[1])))
    first = row_last + 1  # where the first sampled token goes
    rows = rows.at[jnp.arange(rows.shape[0]), first].set(new, mode="drop")
    row_lps = jnp.zeros(rows.shape, jnp.float32).at[jnp.arange(rows.shape[0]), first].set(lp, mode="drop")
    done = (first + 1 >= limits) | _ends_with_stop(rows, first, stops)
    put = lambda a, b: a.at[slot].set(b, mode="drop")  # noqa: E731
    routes = state.routes
    if routes is not None:  # each row's prompt routing; nothing recorded past it (a slot's earlier occupant's goes)
        prompt_routes = jnp.concatenate(experts, axis=-1).astype(routes.dtype)[source]  # [rows, P, layers × k]
        real = jnp.arange(prompts.shape[1])[None, :] < lengths[source][:, None]
        prompt_routes = jnp.where(real[..., None], prompt_routes, NO_EXPERT)
        width = prompts.shape[1]
        routes = put(
            routes, jnp.pad(prompt_routes, ((0, 0), (0, positions - width), (0, 0)), constant_values=NO_EXPERT)
        )
    return _Slots(
        caches=caches,
        tokens=put(state.tokens, rows),
        logprobs=put(state.logprobs, row_lps),
        pos=put(state.pos, first),
        limits=put(state.limits, limits),
        temperatures=put(state.temperatures, temperatures),
        keys=put(state.keys, keys),
        stops=put(state.stops, stops),
        done=put(state.done, done),
        routes=routes,
    )


def _decode(model, sampler: Sampler, state: _Slots, steps):
    """Up to `steps` decode steps of every live slot (fewer when all finish): feed the slot's last token at its
    position, sample the next. Returns (steps taken, live slot-steps among them, the new state)."""
    rows = state.tokens.shape[0]
    last = state.tokens.shape[1] - 1

    def cond(carry):
        i, _, state = carry
        return (i < steps) & ~jnp.all(state.done)

    def body(carry):
        i, live_slot_steps, s = carry
        token = jnp.take_along_axis(s.tokens, s.pos[:, None], axis=1)[:, 0]
        ids = hax.named(token[:, None], ("batch", "position"))
        pos_ids = hax.named(s.pos[:, None], ("batch", "position"))
        x = model.embeddings.embed(ids)
        caches = []
        experts = []
        for layer, cache in zip(model.transformer.layers.unstacked(), s.caches, strict=True):
            x, cache, chosen = _layer_decode(layer, x, cache, s.pos, pos_ids)
            caches.append(cache)
            experts.append(chosen)
        logits = _head(model, x)["position", 0]
        new, lp = _sample(sampler, logits, s.temperatures, s.keys, s.pos)
        live = ~s.done
        at = jnp.minimum(s.pos + 1, last)
        r = jnp.arange(rows)
        tokens = s.tokens.at[r, at].set(jnp.where(live, new, s.tokens[r, at]))
        logprobs = s.logprobs.at[r, at].set(jnp.where(live, lp, s.logprobs[r, at]))
        pos = jnp.where(live, at, s.pos)
        finished = (pos + 1 >= s.limits) | _ends_with_stop(tokens, pos, s.stops)
        done = s.done | (live & finished)
        routes = s.routes
        if routes is not None:  # the routing of the token fed at each live slot's position
            fed = jnp.concatenate(experts, axis=-1)[:, 0].astype(routes.dtype)  # [slot, layers × k]
            routes = routes.at[r, s.pos].set(jnp.where(live[:, None], fed, routes[r, s.pos]))
        state = dataclasses.replace(
            s, caches=caches, tokens=tokens, logprobs=logprobs, pos=pos, done=done, routes=routes
        )
        return i + 1, live_slot_steps + jnp.sum(live, dtype=jnp.int32), state

    return jax.lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(0), state))


def _bucket(n: int, floor: int, cap: int, base: int = 2) -> int:
    """The smallest power of `base` times `floor` that holds `n`, capped at `cap`."""
    size = floor
    while size < n:
        size *= base
    return min(size, cap)


@dataclass
class DecodeStats:
    """What `DenseEngine.run` did, summed over its calls."""

    prefill_calls: int = 0
    prefilled_prompts: int = 0
    """Distinct prompts prefilled (a group's samples share one)."""
    admitted: int = 0
    """Sequences started in a slot."""
    decode_calls: int = 0
    decode_steps: int = 0
    """Decode steps at which at least one slot was live."""
    slot_steps: int = 0
    """Slot-steps of those decode steps (slots × steps): live_slot_steps / slot_steps is the slots' occupancy."""
    live_slot_steps: int = 0


class DenseEngine:
    """Decodes Levanter `Request`s (one generation each) with a dense KV cache of `max_seqs` slots, batching
    continuously; `generate` returns a Levanter `GenerationResult`, so it stands in for Levanter's engine in the
    embedded server. `model` may be replaced between calls by one of the same structure and shardings (nothing
    recompiles). `batch_invariant`: always `max_seqs` slots and one prefill shape, so a sequence's results are
    bit-identical whatever shares its call."""

    def __init__(
        self,
        model: LmHeadModel,
        sampler: Sampler,
        *,
        max_seqs: int,
        max_seq_len: int,
        max_stop_seqs: int,
        max_stop_tokens: int,
        cache_dtype=jnp.float32,
        batch_invariant: bool = False,
        record_routing: bool = False,
        decode_steps: int = 16,
        prefill_tokens: int = 4096,
    ):
        check_supported(model)
        if decode_steps < 1 or prefill_tokens < 1:
            raise ValueError(f"decode_steps and prefill_tokens must be >= 1, got {decode_steps}, {prefill_tokens}")
        self.model = model
        self.sampler = sampler
        self.max_seqs = max_seqs
        self.max_seq_len = max_seq_len
        self.max_stop_seqs = max_stop_seqs
        self.max_stop_tokens = max_stop_tokens
        self.cache_dtype = cache_dtype
        self.batch_invariant = batch_invariant
        self.record_routing = record_routing and routes_experts(model)
        """Record a mixture of experts' routing of every fed token (`run`'s routes; else None)."""
        self.decode_steps = decode_steps
        """Decode steps per device call while sequences wait for a slot (a finished slot refills after at most this
        many); with nothing waiting a call decodes to the end."""
        self.prefill_tokens = prefill_tokens
        """Prompt tokens (distinct prompts × their padded length) one prefill call takes at most."""
        # batch_invariant: one slot count, so no row's arithmetic depends on how many others share its call
        self.buckets = [max_seqs] if batch_invariant else sorted({min(b, max_seqs) for b in BATCH_BUCKETS} | {max_seqs})
        self.mesh = expert_mesh(model) if routes_experts(model) else None
        """The device mesh the engine's programs run under: a mixture-of-experts model's (`expert_mesh`), else None
        (no mesh)."""
        self._empty = eqx.filter_jit(_empty_slots)
        self._admit = eqx.filter_jit(_admit, donate="all-except-first")
        self._decode = eqx.filter_jit(_decode, donate="all-except-first")
        self.stats = DecodeStats()
        self.model_version = -1
        """The policy version of `model` (its owner sets both)."""
        self.call_guard: Callable[[int, tuple], contextlib.AbstractContextManager] | None = None
        """Entered around every decode call with (`model_version`, the call's input arrays): a multi-process run
        orders its processes' device work with it (`marin_rl.orchestrator.local_backend.spmd`)."""

    def compiled_programs(self) -> int:
        """How many programs the engine has compiled (a new model of the same structure must not add any)."""
        return sum(f._cached._cache_size() for f in (self._empty, self._admit, self._decode))

    def generate(
        self,
        requests: Sequence[Request],
        more: Callable[[int], Sequence[Request]] | None = None,
        finished: Callable[[int, list[int], list[float], np.ndarray | None], None] | None = None,
    ) -> DenseGenerationResult:
        """Sample each request's generation (`n_generations` must be 1): tokens after its prompt up to
        `decode_params.max_num_tokens` tokens in all (prompt included) or one of its stop sequences (included), at
        its temperature, with its key. Any number of requests: beyond `max_seqs` they wait for a free slot. Raises
        ValueError for a prompt that does not fit.

        `more(positions)`: requests that arrived since, asked while a slot is free (each must reach at most
        `positions` tokens in all); they join this call after `requests`, and the result covers them too.
        `finished(i, tokens, logprobs, routes)`: request i's generation as soon as it ends (`routes`: see `run`). `more`
        needs a single-process engine (no `call_guard`: other processes could not replay the arrivals)."""
        joined = list(requests)
        inputs = self.prepare(joined)
        arrivals = None
        if more is not None:
            if self.call_guard is not None:
                raise ValueError("a multi-process engine (call_guard set) cannot take requests during a call")

            def arrivals(positions: int):
                new = list(more(positions))
                joined.extend(new)
                return self.prepare(new) if new else None

        told = None if finished is None else (lambda row, t, lp, rt: finished(row, t.tolist(), lp.tolist(), rt))
        with self.call_guard(self.model_version, inputs) if self.call_guard is not None else contextlib.nullcontext():
            out, logprobs, sampled, routes = self.run(inputs, arrivals, told)
        result_tokens, result_logprobs, result_routes = [], [], []
        for i, r in enumerate(joined):
            a = len(r.prompt_tokens)
            b = a + int(sampled[i])
            result_tokens.append(out[i, a:b].tolist())
            result_logprobs.append(logprobs[i, a:b].tolist())
            result_routes.append(None if routes is None else routes[i, :b])
        total = int(sum(len(t) for t in result_tokens))
        return DenseGenerationResult(result_tokens, result_logprobs, total, routes=result_routes)

    def prepare(self, requests: Sequence[Request]) -> tuple[np.ndarray, ...]:
        """The host arrays one `run` takes for `requests`, one row each: (tokens [n, max_seq_len], lengths, limits,
        temperatures, keys, stops)."""
        n = len(requests)
        if any(r.n_generations != 1 for r in requests):
            raise ValueError("the dense engine samples one generation per request (n_generations=1)")
        S = self.max_seq_len
        tokens = np.zeros((n, S), np.int32)
        lengths = np.ones(n, np.int32)
        limits = np.ones(n, np.int32)
        temperatures = np.ones(n, np.float32)
        keys = np.zeros((n, 2), np.uint32)
        stops = np.full((n, self.max_stop_seqs, self.max_stop_tokens), INVALID, np.int32)
        for i, r in enumerate(requests):
            prompt = list(r.prompt_tokens)
            if not 0 < len(prompt) < S:
                raise ValueError(f"a prompt of {len(prompt)} tokens does not fit the dense engine's {S} positions")
            params = r.decode_params
            tokens[i, : len(prompt)] = prompt
            lengths[i] = len(prompt)
            limits[i] = min(int(params.max_num_tokens), S)
            temperatures[i] = float(params.temperature)
            keys[i] = np.asarray(params.key, np.uint32)
            if params.stop_tokens is not None:
                st = np.asarray(params.stop_tokens.array, np.int32)  # [K, L] left padded
                stops[i, : st.shape[0], self.max_stop_tokens - st.shape[1] :] = st
        return tokens, lengths, limits, temperatures, keys, stops

    def run(
        self,
        inputs: tuple[np.ndarray, ...],
        more: Callable[[int], tuple[np.ndarray, ...] | None] | None = None,
        finished: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """Decode `prepare`'s rows with the current model, continuously batched: (tokens [n, max_seq_len], logprobs
        of the sampled positions, number sampled per row, routes) on the host. `routes` [n, max_seq_len, layers × k]
        (a mixture of experts' only, else None): the experts each token fed to the model went to in each expert
        layer (layer-major; the prompt's in the prefill, each sampled token's in the decode step that fed it), and
        `NO_EXPERT` where none was fed (a row's last sampled token, padding).

        `more(positions)`, when given, is asked between decode chunks while a slot is free for rows that arrived
        since (`prepare`'s arrays, each row reaching at most `positions` tokens in all; None or no rows: none); they
        join the call as rows n, n+1, ... and the results cover them too. `finished(row, tokens, logprobs, routes)` is
        told each row's sampled tokens and their logprobs as soon as it finishes, with its routes up to its last
        token (or None). Over several processes (a model sharded
        across hosts) every process must make the same call, without `more`: every decision here follows from the
        inputs and the gathered outputs."""
        if self.mesh is None:
            return self._run(inputs, more, finished)
        # Levanter's expert blocks route in a shard_map over the mesh; no axis mapping: their routing is replicated
        with hax.partitioning.set_mesh(self.mesh), hax.axis_mapping({}):
            return self._run(inputs, more, finished)

    def _run(self, inputs, more, finished):
        """`run`'s body, under the engine's mesh if it has one."""
        tokens, lengths, limits, temperatures, keys, stops = inputs
        n = tokens.shape[0]
        out_tokens, out_logprobs = tokens.copy(), np.zeros(tokens.shape, np.float32)
        sampled = np.zeros(n, np.int32)
        shape = routing_shape(self.model) if self.record_routing else None
        width_routes = None if shape is None else shape[0] * shape[1]
        out_routes = None if shape is None else np.full((n, tokens.shape[1], width_routes), NO_EXPERT, ROUTE_DTYPE)

        def routes_of(row: int, end: int) -> np.ndarray | None:
            return None if out_routes is None else out_routes[row, :end]

        waiting = collections.deque(i for i in range(n) if lengths[i] < limits[i])  # the others sample nothing
        if finished is not None:
            for i in range(n):
                if lengths[i] >= limits[i]:
                    finished(i, out_tokens[i, :0], out_logprobs[i, :0], routes_of(i, 0))
        if not waiting:
            return out_tokens, out_logprobs, sampled, out_routes
        slots = (
            self.buckets[-1] if len(waiting) > self.buckets[-1] else next(b for b in self.buckets if b >= len(waiting))
        )
        # the cache spans the positions this call's sequences can reach (rounded up to a power of two: few programs)
        width = self.max_seq_len if self.batch_invariant else _bucket(int(limits.max()), 64, self.max_seq_len)
        state = self._empty(self.model, slots, width, stops.shape[1:], self.cache_dtype, self.record_routing)
        occupant = [-1] * slots  # request row in each slot
        while True:
            free = [s for s in range(slots) if occupant[s] < 0]
            if more is not None and free and len(waiting) < len(free):
                arrived = more(width)
                if arrived is not None and len(arrived[0]):
                    if int(arrived[2].max()) > width:
                        raise ValueError(f"more() gave a row of {int(arrived[2].max())} tokens; at most {width} fit")
                    inputs = tuple(np.concatenate([a, b]) for a, b in zip(inputs, arrived, strict=True))
                    tokens, lengths, limits = inputs[:3]
                    out_tokens = np.concatenate([out_tokens, arrived[0]])
                    out_logprobs = np.concatenate([out_logprobs, np.zeros(arrived[0].shape, np.float32)])
                    sampled = np.concatenate([sampled, np.zeros(len(arrived[0]), np.int32)])
                    if out_routes is not None:
                        more_routes = np.full((len(arrived[0]), *out_routes.shape[1:]), NO_EXPERT, ROUTE_DTYPE)
                        out_routes = np.concatenate([out_routes, more_routes])
                    for i in range(n, len(tokens)):
                        if lengths[i] < limits[i]:
                            waiting.append(i)
                        elif finished is not None:
                            finished(i, out_tokens[i, :0], out_logprobs[i, :0], routes_of(i, 0))
                    n = len(tokens)
            if not waiting and all(o < 0 for o in occupant):
                return out_tokens, out_logprobs, sampled, out_routes
            if waiting and free:
                rows = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
                for row, slot in zip(rows, free, strict=False):
                    occupant[slot] = row
                state = self._start(state, inputs, rows, free[: len(rows)], slots)
            steps = self.decode_steps if waiting or more is not None else width
            taken, live, state = self._decode(self.model, self.sampler, state, np.asarray(steps, np.int32))
            taken, live, done, pos = (_to_host(x) for x in (taken, live, state.done, state.pos))
            self.stats.decode_calls += 1
            self.stats.decode_steps += int(taken)
            self.stats.slot_steps += int(taken) * slots
            self.stats.live_slot_steps += int(live)
            ended = [s for s in range(slots) if occupant[s] >= 0 and done[s]]
            if ended:
                host_tokens, host_logprobs = _to_host(state.tokens), _to_host(state.logprobs)
                # only the ended slots' routes leave the devices (the whole array is slots × positions × layers × k)
                host_routes = None if out_routes is None else _to_host(state.routes[np.asarray(ended)])
                for j, s in enumerate(ended):
                    row = occupant[s]
                    out_tokens[row, :width] = host_tokens[s]
                    out_logprobs[row, :width] = host_logprobs[s]
                    if host_routes is not None:
                        out_routes[row, :width] = host_routes[j]
                    sampled[row] = pos[s] + 1 - lengths[row]
                    occupant[s] = -1
                    if finished is not None:
                        a, b = lengths[row], lengths[row] + sampled[row]
                        finished(row, out_tokens[row, a:b], out_logprobs[row, a:b], routes_of(row, b))

    def _start(self, state: _Slots, inputs, rows: list[int], free: list[int], slots: int) -> _Slots:
        """Admit request `rows` into slots `free`: prefill their distinct prompts (in calls of at most
        `prefill_tokens` prompt tokens) and sample each one's first token."""
        tokens, lengths, limits, temperatures, keys, stops = inputs
        distinct: dict[bytes, int] = {}  # prompt -> index among the distinct prompts
        source = []
        for row in rows:
            prompt = tokens[row, : lengths[row]]
            source.append(distinct.setdefault(prompt.tobytes(), len(distinct)))
        prompt_rows = [rows[source.index(u)] for u in range(len(distinct))]  # each prompt's first row
        positions = state.tokens.shape[1]
        width = positions if self.batch_invariant else _bucket(int(lengths[rows].max()), 16, positions)
        per_call = max(1, self.prefill_tokens // width)
        for first in range(0, len(prompt_rows), per_call):
            group = range(first, min(first + per_call, len(prompt_rows)))
            members = [i for i, u in enumerate(source) if u in group]
            u_rows = per_call if self.batch_invariant else _bucket(len(group), 1, per_call, base=4)
            m_rows = slots  # the rows that start: always the slot count (one program fewer per prefill shape)
            prompts = np.zeros((u_rows, width), np.int32)
            prompt_lengths = np.ones(u_rows, np.int32)
            for j, u in enumerate(group):
                prompts[j] = tokens[prompt_rows[u], :width]
                prompt_lengths[j] = lengths[prompt_rows[u]]
            pad = m_rows - len(members)
            member_rows = [rows[i] for i in members] + [rows[members[0]]] * pad
            state = self._admit(
                self.model,
                self.sampler,
                state,
                prompts,
                prompt_lengths,
                np.asarray([source[i] - first for i in members] + [0] * pad, np.int32),
                np.asarray([free[i] for i in members] + [slots] * pad, np.int32),  # slot `slots`: padding, dropped
                limits[member_rows],
                temperatures[member_rows],
                keys[member_rows],
                stops[member_rows],
            )
            self.stats.prefill_calls += 1
            self.stats.prefilled_prompts += len(group)
            self.stats.admitted += len(members)
        return state


@dataclass
class DenseGenerationResult(GenerationResult):
    """Levanter's `GenerationResult`, with a mixture of experts' routing of each request's tokens."""

    routes: list[np.ndarray | None] | None = None
    """Per request: [prompt + sampled tokens, layers × k] the experts each token went to in each expert layer
    (layer-major; `marin_rl.model.moe.NO_EXPERT` for the last sampled token, never fed), or None (a dense model)."""


def _to_host(x: jax.Array) -> np.ndarray:
    """A host copy of an output array, also when it spans several processes' devices (then every process gathers it:
    they all run the same call)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
