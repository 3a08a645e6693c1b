"""The policy model: its configuration, building it (random or from a Hugging Face checkpoint), its size."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import equinox as eqx
import haliax as hax
import jax
from levanter.layers.attention import AttentionBackend
from levanter.models.llama import LlamaConfig
from levanter.models.lm_model import LmConfig, LmHeadModel

from marin_rl.bounds import bounded, check_fields, positive_unless_zero_default
from marin_rl.model.hf import load_hf_model
from marin_rl.model.linear_gradients import with_layout_aware_gradients


def tiny_llama() -> LlamaConfig:
    """The project's default model: a small Llama that trains in seconds on a CPU."""
    return LlamaConfig(
        max_seq_len=128,
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


MATMUL_PRECISIONS = ("default", "high", "highest")
"""JAX's names for the precision of float32 matrix products (`jax_default_matmul_precision`)."""


@dataclass
class ModelConfig:
    """The policy model."""

    architecture: LmConfig = bounded(default_factory=tiny_llama, each=positive_unless_zero_default)
    """Any Levanter language-model config, chosen by `type:` (llama, qwen, gemma, mistral, ...). Every number in it
    must be positive, or >= 0 where Levanter's default is 0 (dropout rates: 0 is none)."""
    seed: int = bounded(0, ge=0)
    """PRNG seed for random initialisation (an integer >= 0)."""
    init_from_hf: str | None = None
    """Local or gs:// directory of a Hugging Face checkpoint to initialise the policy from (its config must match
    `architecture`'s type and sizes), or a GGUF file (`.gguf`: dequantised and converted once into a cached Hugging
    Face directory, `marin_rl.gguf`); None initialises randomly."""
    export_every: int = bounded(0, ge=0)
    """Export the policy as an HF checkpoint to `output_dir/hf/step-N` every this many learner steps (0: only at
    the end)."""
    gradient_checkpointing: bool | str | None = False
    """Rematerialisation of the layers' activations in the backward pass; replaces `architecture`'s own setting
    (whose Levanter default is on). false: keep every activation, no recomputation (the right choice while
    activations fit in memory, as they do for small models: recomputing the forward costs about a third more
    FLOPs per step); true: keep each layer's input and recompute its internals; 'offload' (inputs kept on the
    host), 'recompute' (recompute everything), 'nested' (√layers blocks); null: the architecture's own setting."""
    cpu_attention_block_size: int | None = bounded(128, ge=1)
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
    matmul_precision: str | None = None
    """JAX's default precision of float32 matrix products in every process of the run (learner and embedded
    engines alike, so sampler and learner still agree): null keeps JAX's default, which on NVIDIA GPUs multiplies in
    TF32 (a float32 model's logprobs then differ from Hugging Face's float32 ones by ~5e-3 nats; measured on an H100)
    and on TPUs in bfloat16 passes; 'highest' computes in full float32 (within ~4e-6 of Hugging Face's on the H100,
    at a cost in speed measured there: a float32 matmul 7x slower than TF32, a ~100M model's train step 2.4x
    slower); 'high' is in between. No effect on CPU, which always computes in float32."""

    def __post_init__(self):
        check_fields(self, "model")
        gc = self.gradient_checkpointing
        if isinstance(gc, str) and gc not in GRADIENT_CHECKPOINTING_POLICIES:
            raise ValueError(
                f"model.gradient_checkpointing must be true, false, null or one of {GRADIENT_CHECKPOINTING_POLICIES}, "
                f"got {gc!r}"
            )
        if self.init_from_hf is not None and not self.init_from_hf.strip():
            raise ValueError("model.init_from_hf must be a directory path or URL, or null; got an empty string")
        if self.matmul_precision is not None and self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(
                f"model.matmul_precision must be null or one of {MATMUL_PRECISIONS}, got {self.matmul_precision!r}"
            )


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


def parameter_count(model: LmHeadModel) -> int:
    """Number of trainable parameters."""
    leaves = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_inexact_array))
    return int(sum(x.size for x in leaves))


def with_seq_len(config: ModelConfig, seq_len: int) -> ModelConfig:
    """Make sure the architecture's context (`max_seq_len`) covers `seq_len` tokens."""
    arch = config.architecture
    if getattr(arch, "max_seq_len", seq_len) < seq_len:
        arch = dataclasses.replace(arch, max_seq_len=seq_len)
    return dataclasses.replace(config, architecture=arch)
