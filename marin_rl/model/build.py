"""Building the policy model (random or from a Hugging Face checkpoint) from its configuration
(`marin_rl.model.config`), and its size."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import haliax as hax
import jax
from levanter.layers.attention import AttentionBackend
from levanter.models.lm_model import LmConfig, LmHeadModel

from marin_rl.model.config import ModelConfig
from marin_rl.model.hf import load_hf_model
from marin_rl.model.linear_gradients import with_layout_aware_gradients


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
