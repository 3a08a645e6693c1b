"""Building the policy model and computing per-token logprobs of packed rows."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from levanter.layers.attention import AttentionMask
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

    def __post_init__(self):
        if not isinstance(self.export_every, int) or isinstance(self.export_every, bool) or self.export_every < 0:
            raise ValueError(f"model.export_every must be an integer >= 0, got {self.export_every!r}")
        if self.init_from_hf is not None and not self.init_from_hf.strip():
            raise ValueError("model.init_from_hf must be a directory path or URL, or null; got an empty string")


def build_model(config: ModelConfig, vocab_size: int) -> LmHeadModel:
    """The policy with float32 parameters: loaded from `config.init_from_hf`, or randomly initialised."""
    if config.init_from_hf is not None:
        return load_hf_model(config.architecture, config.init_from_hf, vocab_size)
    Vocab = hax.Axis("vocab", vocab_size)
    return config.architecture.build(Vocab, key=jax.random.PRNGKey(config.seed))


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
    logits = model(input_ids, attn_mask=packed_attention_mask(segment_ids), pos_ids=position_ids)
    logits = logits.astype(jnp.float32) / temperature
    Vocab = model.Vocab
    log_z = hnn.logsumexp(logits, axis=Vocab)
    log_probs_all = logits - log_z
    # logits[t-1] predict token t: shift targets left by one.
    next_ids = hax.roll(input_ids, -1, Pos)
    ordered = log_probs_all.rearrange((*input_ids.axes, Vocab)).array
    target_lp = hax.named(
        jnp.take_along_axis(ordered, next_ids.array[..., None], axis=-1)[..., 0], input_ids.axes
    )  # value at t-1 is about token t
    probs = hax.exp(log_probs_all)
    entropy = -hax.sum(probs * log_probs_all, axis=Vocab)
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
