"""A dense-cache sampler for the embedded server: every sequence of a batch decoded in one compiled loop.

Levanter's engine (`levanter.inference.engine`) serves from a paged KV cache with a scheduler that admits, prefills,
decodes and retires sequences in many small device programs; on a TPU its kernels make that fast. On a CPU, for the
short sequences of small models, the bookkeeping and the reference attention (one sequence and one query token at a
time) cost far more than the model: ~0.2 s for 200 prompts × 5 tokens of a 0.56M-parameter model, most of it outside
the matrix products.

`DenseEngine` decodes a batch of up to `max_seqs` sequences position by position in a single `while_loop`: at step t
every row feeds its token at position t through the model (its prompt's token, or the one it sampled), writes the
key and value into a dense cache of `max_seq_len` positions per row, and rows past their prompt sample position t+1.
The loop ends when every row has stopped (a stop sequence, its token limit). Prompts are read one token per step, so
its cost is (longest prompt + longest completion) × rows: right for short prompts and completions, wrong for long
contexts, where the paged engine's batched prefill wins (`inference.levanter.engine: paged`).

Sampling is Levanter's: the same sampler module, and per token the key `fold_in(key(seed), position)` of the position
whose logits are sampled, as the paged engine derives it, so a seeded request's samples do not depend on which
other requests share its batch, and a generation continued in segments samples what one pass would. Supported
models are Levanter's Llama family (Llama, Mistral, Qwen: `LlamaDecoderLayer`s with plain multi-head attention);
`DenseEngine` raises ValueError for others.
"""

from __future__ import annotations

import contextlib
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
from levanter.models.qwen import QwenDecoderLayer


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


def check_supported(model: LmHeadModel) -> None:
    """Raise ValueError unless `DenseEngine` can decode `model` (a Levanter model of Llama's or Qwen2's decoder
    layers: Llama, Mistral, Qwen2, Qwen3; checked against transformers per family in tests/test_hf_families.py)."""
    transformer = getattr(model, "transformer", None)
    layers = getattr(transformer, "layers", None)
    if layers is None or not hasattr(layers, "unstacked"):
        raise ValueError(
            f"the dense engine decodes Llama, Mistral, Qwen2 and Qwen3 models; {type(model).__name__} has no layer "
            "stack (use inference.backend: vllm)"
        )
    layer = layers.unstacked()[0]
    if isinstance(layer, QwenDecoderLayer) and layer.config.use_sliding_window:
        raise ValueError("the dense engine has no sliding-window attention (use inference.levanter.engine: paged)")
    if not isinstance(layer, LlamaDecoderLayer | QwenDecoderLayer):  # Qwen2: Llama's layer without extra norms
        raise ValueError(
            f"the dense engine decodes Llama, Mistral, Qwen2 and Qwen3 models (their decoder layer stacks), not "
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


def _layer_step(layer: LlamaDecoderLayer | QwenDecoderLayer, x: hax.NamedArray, cache, t, pos_ids: hax.NamedArray):
    """One decoder layer on one token per row (`x`: [batch, position=1, embed]) at position `t`, reading and
    extending the dense cache (keys [batch, kv_head, head_size, S], values [batch, kv_head, S, head_size]); mirrors
    `LlamaDecoderLayer.decode` with `Attention.paged_decode`."""
    keys, values = cache
    attn: Attention = layer.self_attn
    residual = x
    h = layer.input_layernorm(x)
    q, k, v = attn._compute_qkv(h, key=None, pos_ids=pos_ids)
    new_k = k.rearrange(("batch", "kv_head", "head_size", "position")).array.astype(keys.dtype)
    new_v = v.rearrange(("batch", "kv_head", "position", "head_size")).array.astype(values.dtype)
    keys = jax.lax.dynamic_update_slice(keys, new_k, (0, 0, 0, t))
    values = jax.lax.dynamic_update_slice(values, new_v, (0, 0, t, 0))
    cfg = attn.config
    scale = cfg.scaling_factor if cfg.scaling_factor is not None else 1.0 / math.sqrt(cfg.HeadSize.size)
    qa = q.rearrange(("batch", "kv_head", "q_heads_per_group", "head_size", "position")).array[..., 0]
    scores = jnp.einsum("bhgd,bhds->bhgs", (qa * scale).astype(jnp.float32), keys.astype(jnp.float32))
    if cfg.logits_soft_cap is not None:
        scores = jnp.tanh(scores / cfg.logits_soft_cap) * cfg.logits_soft_cap
    scores = jnp.where(jnp.arange(keys.shape[-1]) <= t, scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgs,bhsd->bhgd", weights, values.astype(jnp.float32))
    out = hax.named(out[:, None], ("batch", "position", "kv_head", "q_heads_per_group", "head_size"))
    out = out.flatten_axes(("kv_head", "q_heads_per_group"), "heads").astype(x.dtype)
    attn_output = attn.o_proj(out, key=None)
    if getattr(layer, "post_attn_layernorm", None) is not None:
        attn_output = layer.post_attn_layernorm(attn_output)
    x = residual + attn_output
    residual = x
    mlp_output = layer.mlp(layer.post_attention_layernorm(x), key=None)
    if getattr(layer, "post_mlp_layernorm", None) is not None:
        mlp_output = layer.post_mlp_layernorm(mlp_output)
    return residual + mlp_output, (keys, values)


def _model_step(model: LmHeadModel, caches, tokens: jnp.ndarray, t):
    """Logits [batch, vocab] after feeding `tokens` (one per row) at position `t`, and the extended caches."""
    ids = hax.named(tokens[:, None], ("batch", "position"))
    pos_ids = hax.named(jnp.full((tokens.shape[0], 1), t, jnp.int32), ("batch", "position"))
    x = model.embeddings.embed(ids)
    new_caches = []
    for layer, cache in zip(model.transformer.layers.unstacked(), caches, strict=True):
        x, cache = _layer_step(layer, x, cache, t, pos_ids)
        new_caches.append(cache)
    x = model.transformer.norm(x)
    logits = model.lm_head(x, key=None) if model.lm_head is not None else model.embeddings.unembed(x)
    return logits["position", 0], new_caches


def _ends_with_stop(tokens: jnp.ndarray, end, stops: jnp.ndarray) -> jnp.ndarray:
    """Per row: whether tokens[:, :end + 1] ends with one of the row's stop sequences (`stops` [batch, K, L], left
    padded with INVALID; an all-INVALID sequence never matches)."""
    length = stops.shape[-1]
    padded = jnp.pad(tokens, ((0, 0), (length, 0)), constant_values=INVALID)
    window = jax.lax.dynamic_slice_in_dim(padded, end + 1, length, axis=1)  # positions end-L+1 .. end
    used = stops != INVALID
    match = jnp.all(~used | (window[:, None, :] == stops), axis=-1) & jnp.any(used, axis=-1)
    return jnp.any(match, axis=-1)


def _generate(model, sampler: Sampler, tokens, lengths, limits, temperatures, keys, stops, cache_dtype):
    """Decode every row of `tokens` [B, S] (its first `lengths` tokens given) up to `limits` tokens in all or a stop
    sequence; returns (tokens, logprobs of the sampled positions, number sampled per row)."""
    rows, positions = tokens.shape
    cfg = model.transformer.layers.unstacked()[0].self_attn.config
    heads, head_size = cfg.KVHeads.size, cfg.HeadSize.size
    caches = [
        (
            jnp.zeros((rows, heads, head_size, positions), cache_dtype),
            jnp.zeros((rows, heads, positions, head_size), cache_dtype),
        )
        for _ in model.transformer.layers.unstacked()
    ]
    logprobs = jnp.zeros((rows, positions), jnp.float32)
    sampled = jnp.zeros((rows,), jnp.int32)
    done = lengths >= limits

    def cond(state):
        t, _, _, _, _, done = state
        return (t < positions - 1) & ~jnp.all(done)

    def body(state):
        t, caches, tokens, logprobs, sampled, done = state
        logits, caches = _model_step(model, caches, tokens[:, t], t)
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, t)
        # top_ps=None: the whole distribution at the row's temperature (no nucleus filter to compute)
        new, lp = hax.vmap(sampler, "batch")(logits, hax.named(temperatures, "batch"), top_ps=None, key=step_keys)
        writes = (t + 1 >= lengths) & ~done  # rows sampling position t+1
        tokens = tokens.at[:, t + 1].set(jnp.where(writes, new.array, tokens[:, t + 1]))
        logprobs = logprobs.at[:, t + 1].set(jnp.where(writes, lp.array, 0.0))
        sampled = sampled + writes
        finished = (t + 2 >= limits) | _ends_with_stop(tokens, t + 1, stops)
        return t + 1, caches, tokens, logprobs, sampled, done | (writes & finished)

    start = (jnp.int32(0), caches, tokens, logprobs, sampled, done)
    _, _, tokens, logprobs, sampled, _ = jax.lax.while_loop(cond, body, start)
    return tokens, logprobs, sampled


class DenseEngine:
    """Decodes batches of Levanter `Request`s (one generation each) with a dense KV cache; `generate` returns a
    Levanter `GenerationResult`, so it stands in for Levanter's engine in the embedded server. `model` may be
    replaced between calls by one of the same structure and shardings (nothing recompiles). `batch_invariant`: every
    batch padded to `max_seqs` rows, so a row's results are bit-identical whatever shares its batch."""

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
    ):
        check_supported(model)
        self.model = model
        self.sampler = sampler
        self.max_seqs = max_seqs
        self.max_seq_len = max_seq_len
        self.max_stop_seqs = max_stop_seqs
        self.max_stop_tokens = max_stop_tokens
        self.cache_dtype = cache_dtype
        # batch_invariant: one row count, so no row's arithmetic depends on how many others share its batch
        self.buckets = [max_seqs] if batch_invariant else sorted({min(b, max_seqs) for b in BATCH_BUCKETS} | {max_seqs})
        self._jitted = eqx.filter_jit(_generate)
        self.model_version = -1
        """The policy version of `model` (its owner sets both)."""
        self.call_guard: Callable[[int, tuple], contextlib.AbstractContextManager] | None = None
        """Entered around every decode call with (`model_version`, the call's input arrays): a multi-process run
        orders its processes' device work with it (`marin_rl.orchestrator.local_backend.spmd`)."""

    def generate(self, requests: Sequence[Request]) -> GenerationResult:
        """Sample each request's generation (`n_generations` must be 1): tokens after its prompt up to
        `decode_params.max_num_tokens` tokens in all (prompt included) or one of its stop sequences (included), at
        its temperature, with its key. Raises ValueError for more than `max_seqs` requests or a prompt that does not
        fit."""
        inputs = self.prepare(requests)
        with self.call_guard(self.model_version, inputs) if self.call_guard is not None else contextlib.nullcontext():
            out, logprobs, sampled = self.run(inputs)
        lengths = inputs[1]
        result_tokens, result_logprobs = [], []
        for i in range(len(requests)):
            a, b = lengths[i], lengths[i] + int(sampled[i])
            result_tokens.append([int(x) for x in out[i, a:b]])
            result_logprobs.append([float(x) for x in logprobs[i, a:b]])
        return GenerationResult(result_tokens, result_logprobs, int(sum(len(t) for t in result_tokens)))

    def prepare(self, requests: Sequence[Request]) -> tuple[np.ndarray, ...]:
        """The host arrays one decode call takes for `requests`: (tokens, lengths, limits, temperatures, keys, stops),
        padded to the batch's row bucket."""
        n = len(requests)
        if n > self.max_seqs:
            raise ValueError(f"{n} requests exceed the dense engine's max_seqs={self.max_seqs}")
        if any(r.n_generations != 1 for r in requests):
            raise ValueError("the dense engine samples one generation per request (n_generations=1)")
        rows = next(b for b in self.buckets if b >= n)
        S = self.max_seq_len
        tokens = np.zeros((rows, S), np.int32)
        lengths = np.ones(rows, np.int32)
        limits = np.ones(rows, np.int32)  # padding rows: nothing to generate
        temperatures = np.ones(rows, np.float32)
        keys = np.zeros((rows, 2), np.uint32)
        stops = np.full((rows, self.max_stop_seqs, self.max_stop_tokens), INVALID, np.int32)
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

    def run(self, inputs: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One decode call on `prepare`'s arrays with the current model: (tokens, logprobs, sampled per row) on the
        host. Over several processes (a model sharded across hosts) every process must make the same call."""
        outputs = self._jitted(self.model, self.sampler, *inputs, self.cache_dtype)
        return tuple(_to_host(x) for x in outputs)


def _to_host(x: jax.Array) -> np.ndarray:
    """A host copy of an output array, also when it spans several processes' devices (then every process gathers it:
    they all run the same call)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
