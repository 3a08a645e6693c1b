"""Building the policy model and computing per-token logprobs of packed rows."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import partial

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax.quantization import DefaultDotGeneralOp
from levanter.layers.attention import AttentionBackend, AttentionMask
from levanter.models.llama import LlamaConfig
from levanter.models.lm_model import LmConfig, LmHeadModel

from marin_rl.learner.hf_checkpoints import load_hf_model


def tiny_llama() -> LlamaConfig:
    """The project's default model: a small Llama that trains in seconds on a CPU."""
    return LlamaConfig(
        seq_len=128,
        hidden_dim=128,
        intermediate_dim=512,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        gradient_checkpointing=False,
        scan_layers=True,
        tie_word_embeddings=False,
    )


GRADIENT_CHECKPOINTING_POLICIES = ("offload", "recompute", "full", "save_all", "nested")
"""Named rematerialisation policies of `haliax.ScanCheckpointPolicy.from_bool_or_str`."""


@dataclass
class ModelConfig:
    """The policy model."""

    architecture: LmConfig = field(default_factory=tiny_llama)
    """Any Levanter language-model config, chosen by `type:` (llama, qwen, gemma, mistral, ...)."""
    seed: int = 0
    """PRNG seed for random initialisation."""
    init_from_hf: str | None = None
    """Local or gs:// directory of a Hugging Face checkpoint to initialise the policy from (its config must match
    `architecture`'s type and sizes); None initialises randomly."""
    export_every: int = 0
    """Export the policy as an HF checkpoint to `output_dir/hf/step-N` every this many learner steps (0: only at
    the end)."""
    gradient_checkpointing: bool | str | None = False
    """Rematerialisation of the layers' activations in the backward pass; replaces `architecture`'s own setting
    (whose Levanter default is on). false: keep every activation, no recomputation (the right choice while
    activations fit in memory, as they do for small models: recomputing the forward costs about a third more
    FLOPs per step); true: keep each layer's input and recompute its internals; 'offload' (inputs kept on the
    host), 'recompute' (recompute everything), 'nested' (√layers blocks); null: the architecture's own setting."""
    cpu_attention_block_size: int | None = 128
    """On CPU devices, attend in blocks of this many query and key positions (Levanter's blockwise "flash"
    attention) when the architecture leaves `attn_backend` and `flash_attention_block_size` unset. Levanter's CPU
    default is plain attention below 1024 positions, which keeps the whole (position × position) score and
    probability arrays of every layer for the backward pass; blocks are faster on CPU. Rows whose length is not a
    multiple of the block, or shorter than it, use plain attention. null: Levanter's default. No effect on GPU/TPU."""
    layout_aware_gradients: bool = True
    """Compute the weight gradients of linear layers with a backward rule that picks, for each gradient
    contraction, the operand order whose inputs and output need the fewest transposed copies (XLA:CPU transposes a
    dot's operands into a canonical layout; the default order copies the (tokens × mlp) activation gradients). The
    values are those of `jax.lax.dot_general`'s own rule, up to float summation order."""

    def __post_init__(self):
        if not isinstance(self.export_every, int) or isinstance(self.export_every, bool) or self.export_every < 0:
            raise ValueError(f"model.export_every must be an integer >= 0, got {self.export_every!r}")
        block = self.cpu_attention_block_size
        if block is not None and (not isinstance(block, int) or isinstance(block, bool) or block < 1):
            raise ValueError(f"model.cpu_attention_block_size must be an integer >= 1 or null, got {block!r}")
        gc = self.gradient_checkpointing
        if isinstance(gc, str) and gc not in GRADIENT_CHECKPOINTING_POLICIES:
            raise ValueError(
                f"model.gradient_checkpointing must be true, false, null or one of {GRADIENT_CHECKPOINTING_POLICIES}, "
                f"got {gc!r}"
            )
        if self.init_from_hf is not None and not self.init_from_hf.strip():
            raise ValueError("model.init_from_hf must be a directory path or URL, or null; got an empty string")


def resolved_architecture(config: ModelConfig) -> LmConfig:
    """`config.architecture` with `config.gradient_checkpointing` applied (when not null) and, on CPU devices,
    `config.cpu_attention_block_size` (see there)."""
    arch = config.architecture
    if config.gradient_checkpointing is not None and hasattr(arch, "gradient_checkpointing"):
        arch = dataclasses.replace(arch, gradient_checkpointing=config.gradient_checkpointing)
    block = config.cpu_attention_block_size
    if (
        block is not None
        and jax.devices()[0].platform == "cpu"
        and getattr(arch, "flash_attention_block_size", False) is None
        and getattr(arch, "attn_backend", None) in (None, AttentionBackend.DEFAULT, AttentionBackend.JAX_FLASH)
    ):
        arch = dataclasses.replace(arch, flash_attention_block_size=block)
    return arch


def build_model(config: ModelConfig, vocab_size: int) -> LmHeadModel:
    """The policy with float32 parameters: loaded from `config.init_from_hf`, or randomly initialised."""
    arch = resolved_architecture(config)
    if config.init_from_hf is not None:
        model = load_hf_model(arch, config.init_from_hf, vocab_size)
        # The converter leaves the arrays laid out over the one-device mesh it loaded under; plain arrays on the
        # default device (like a random initialisation's) can be placed by any later mesh, the learner's or the
        # inference engine's (which refuses arrays tied to another mesh).
        device = jax.devices()[0]
        model = jax.tree_util.tree_map(lambda x: jax.device_put(x, device) if isinstance(x, jax.Array) else x, model)
    else:
        model = arch.build(hax.Axis("vocab", vocab_size), key=jax.random.PRNGKey(config.seed))
    return with_layout_aware_gradients(model) if config.layout_aware_gradients else model


# ---- linear layers' gradients -------------------------------------------------------------------------------------
def _contract(a: jax.Array, b: jax.Array, pairs: list[tuple[int, int]], out: list[tuple[int, int]], precision):
    """Σ over paired dims (`pairs`: (dim of a, dim of b)) of a·b, with result axes `out` ((0 for a / 1 for b, dim)).

    XLA:CPU computes a dot as `[free, contracted] @ [contracted, free]` in row-major layout and transposes whatever
    does not fit that into a copy. Of the two operand orders this takes the one whose copies (of an operand or of
    the result) hold the fewest elements.
    """
    dtype = jnp.promote_types(a.dtype, b.dtype)
    ops = (a.astype(dtype), b.astype(dtype))
    out_size = math.prod(ops[i].shape[d] for i, d in out)
    best = None
    for first in (0, 1):
        x, y = ops[first], ops[1 - first]
        ordered = sorted((p[first], p[1 - first]) for p in pairs)
        x_c, y_c = [p[0] for p in ordered], [p[1] for p in ordered]
        produced = [(first, d) for d in range(x.ndim) if d not in x_c]
        produced += [(1 - first, d) for d in range(y.ndim) if d not in y_c]
        cost = x.size if x_c != list(range(x.ndim - len(x_c), x.ndim)) else 0
        cost += y.size if y_c != list(range(len(y_c))) else 0
        cost += out_size if produced != out else 0
        if best is None or cost < best[0]:
            best = (cost, x, y, x_c, y_c, produced)
    _, x, y, x_c, y_c, produced = best
    result = jax.lax.dot_general(x, y, ((tuple(x_c), tuple(y_c)), ((), ())), precision=precision)
    perm = tuple(produced.index(o) for o in out)
    return result if perm == tuple(range(len(perm))) else jnp.transpose(result, perm)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _layout_aware_dot(lhs, rhs, contracting, precision, preferred_element_type):
    return jax.lax.dot_general(lhs, rhs, (contracting, ((), ())), precision, preferred_element_type)


def _layout_aware_dot_fwd(lhs, rhs, contracting, precision, preferred_element_type):
    return _layout_aware_dot(lhs, rhs, contracting, precision, preferred_element_type), (lhs, rhs)


def _layout_aware_dot_bwd(contracting, precision, preferred_element_type, residuals, g):
    lhs, rhs = residuals
    lc, rc = contracting
    l_free = [d for d in range(lhs.ndim) if d not in lc]
    r_free = [d for d in range(rhs.ndim) if d not in rc]
    n = len(l_free)  # g's axes: lhs's free dims, then rhs's free dims
    # d lhs = g · rhs over rhs's free dims; d rhs = lhs · g over lhs's free dims (operands: 0 = g or lhs, 1 = the other)
    lhs_out = [(0, l_free.index(d)) if d in l_free else (1, rc[lc.index(d)]) for d in range(lhs.ndim)]
    d_lhs = _contract(g, rhs, [(n + i, d) for i, d in enumerate(r_free)], lhs_out, precision)
    rhs_out = [(1, n + r_free.index(d)) if d in r_free else (0, lc[rc.index(d)]) for d in range(rhs.ndim)]
    d_rhs = _contract(lhs, g, [(d, i) for i, d in enumerate(l_free)], rhs_out, precision)
    return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype)


_layout_aware_dot.defvjp(_layout_aware_dot_fwd, _layout_aware_dot_bwd)


class LayoutAwareDotGeneral(eqx.Module):
    """`jax.lax.dot_general` for `haliax.nn.Linear` whose backward pass orders each gradient contraction (see
    `_contract`) so that few elements are transposed. On XLA:CPU the default rule computes a weight gradient
    `dW[mlp, embed] = Σ_tokens dh[tokens, mlp] · x[tokens, embed]` by copying the whole `dh` (tokens × mlp) into a
    transposed layout; this one copies the smaller `x` (and the weight-sized result) instead. Contractions with
    batch dimensions, or called with extra options, use the default rule."""

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        (lc, rc), (lb, rb) = dimension_numbers
        if lb or rb or kwargs:
            return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs)
        return _layout_aware_dot(lhs, rhs, (tuple(lc), tuple(rc)), precision, preferred_element_type)


def with_layout_aware_gradients(model: eqx.Module) -> eqx.Module:
    """`model` with every linear layer that uses the default `dot_general` switched to `LayoutAwareDotGeneral`
    (same parameters and forward values; see `ModelConfig.layout_aware_gradients`)."""

    def is_linear(x) -> bool:
        return isinstance(x, hnn.Linear)

    def swap(x):
        if is_linear(x) and isinstance(x.dot_general, DefaultDotGeneralOp):
            return eqx.tree_at(lambda lin: lin.dot_general, x, LayoutAwareDotGeneral())
        return x

    return jax.tree_util.tree_map(swap, model, is_leaf=is_linear)


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


def parameter_count(model: LmHeadModel) -> int:
    """Number of trainable parameters."""
    import equinox as eqx

    leaves = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_inexact_array))
    return int(sum(x.size for x in leaves))


def with_seq_len(config: ModelConfig, seq_len: int) -> ModelConfig:
    """Make sure the architecture's context covers `seq_len` tokens."""
    arch = config.architecture
    if getattr(arch, "seq_len", seq_len) < seq_len:
        arch = dataclasses.replace(arch, seq_len=seq_len)
    return dataclasses.replace(config, architecture=arch)
