"""The policy model's configuration (`model`) and its LoRA adapters' (`learner.lora`).

Nothing here imports JAX or Levanter when the module is imported. `ModelConfig.architecture` is any Levanter
language-model config (Llama, Qwen, ...), whose classes import JAX: its annotation names them through a reference to
Levanter's module that imports it when the annotation is resolved (draccus parsing a config, `typing.get_type_hints`),
and the default architecture is built when a `ModelConfig` is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from marin_rl.bounds import bounded, check_fields, positive_unless_zero_default
from marin_rl.deferred_imports import lazy_module

if TYPE_CHECKING:
    from levanter.models.llama import LlamaConfig

lm_model = lazy_module("levanter.models.lm_model")
"""`levanter.models.lm_model`, imported on first use: `ModelConfig`'s annotation `lm_model.LmConfig` resolves to
Levanter's registry of architectures when a config is parsed, not when this module is imported."""


def tiny_llama() -> LlamaConfig:
    """The project's default model: a small Llama that trains in seconds on a CPU."""
    from levanter.models.llama import LlamaConfig

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
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
"""Values of `model.compute_dtype`."""


@dataclass
class ModelConfig:
    """The policy model."""

    architecture: lm_model.LmConfig = bounded(default_factory=tiny_llama, each=positive_unless_zero_default)
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
    compute_dtype: str = "auto"
    """Mixed precision (`marin_rl.model.precision`): parameters and optimizer state stay float32, the forward and
    backward passes compute in this dtype, and logits, logprobs, the loss and its reductions in float32. 'bfloat16',
    'float32', or 'auto': bfloat16 on GPUs and TPUs, float32 on CPUs (whose bfloat16 matrix products are not faster).
    The engines serve the weights cast to the same dtype, so the sampler computes as the learner does (their logprob
    gap at bfloat16 is larger than at float32; the loss's importance-ratio corrections account for it)."""
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
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"model.compute_dtype must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}")
        if self.matmul_precision is not None and self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(
                f"model.matmul_precision must be null or one of {MATMUL_PRECISIONS}, got {self.matmul_precision!r}"
            )


def with_seq_len(config: ModelConfig, seq_len: int) -> ModelConfig:
    """Make sure the architecture's context (`max_seq_len`) covers `seq_len` tokens."""
    arch = config.architecture
    if getattr(arch, "max_seq_len", seq_len) < seq_len:
        arch = dataclasses.replace(arch, max_seq_len=seq_len)
    return dataclasses.replace(config, architecture=arch)


LORA_INITS = ("zero_a", "zero_b")
"""How adapters may start (`LoraConfig.init`)."""


@dataclass
class LoraConfig:
    """LoRA: train low-rank adapters on the linear layers instead of the whole policy (`learner.lora`)."""

    rank: int = bounded(0, ge=0)
    """r, the adapters' rank; 0: no LoRA (every parameter is trained). RL's updates are low-rank: rank 1 to 8 trains
    as well as full fine-tuning there (Schulman et al. 2025, "LoRA Without Regret")."""
    alpha: float = bounded(8.0, gt=0)
    """α: each adapter's product B·A is scaled by α / rank."""
    target_modules: list[str] | str | None = None
    """Which linear layers get adapters, as Levanter's spec: null (every linear layer but the output head), a list of
    module-name suffixes (e.g. [q_proj, v_proj]) or a regular expression over module paths."""
    init: str = "zero_b"
    """How the adapters start (both make B·A = 0, so the adapted policy starts as the base): 'zero_b' (B zero, A
    random: the LoRA paper's and PEFT's) or 'zero_a' (A zero, B random: Levanter's default). On the quickstart,
    zero_b learned as fast per step as full fine-tuning (+0.26 held-out in 100 steps) and zero_a slower (+0.20;
    benchmarks/RESULTS.md)."""
    seed: int = bounded(0, ge=0)
    """PRNG seed of the adapters' random factor (an integer >= 0)."""
    init_from_peft: str | None = None
    """Local or fsspec directory of PEFT-format adapters (`adapter_config.json`, `adapter_model.safetensors`: what a
    run exports under `hf/step-N/peft`, or `peft`'s `save_pretrained`) to start the adapters from instead of
    `init`; its rank and α must match. Pair it with `model.init_from_hf` pointing at the adapters' base."""

    def __post_init__(self):
        check_fields(self, "learner.lora")
        if self.init not in LORA_INITS:
            raise ValueError(f"learner.lora.init must be one of {LORA_INITS}, got {self.init!r}")
        if self.init_from_peft is not None and not str(self.init_from_peft).strip():
            raise ValueError("learner.lora.init_from_peft must be a directory path or URL, or null")
        targets = self.target_modules
        names = isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) and t for t in targets)
        if targets is not None and not isinstance(targets, str) and not names:
            raise ValueError(
                f"learner.lora.target_modules must be null, a list of module names or a regex, got {targets!r}"
            )

    @property
    def enabled(self) -> bool:
        """Whether adapters are trained (rank > 0)."""
        return self.rank > 0

    def levanter(self):
        """The equivalent `levanter.adaptor.lora.LoraConfig` (no dropout: the policy's forward takes no keys),
        imported here: it pulls in JAX and Levanter's DPO and data-store modules."""
        import levanter.adaptor.lora

        return levanter.adaptor.lora.LoraConfig(
            target_modules=self.target_modules,
            r=self.rank,
            alpha=float(self.alpha),
            dropout=0.0,
            zero_init_b=self.init == "zero_b",
            a_init_mode="zero" if self.init == "zero_a" else "random",
        )
