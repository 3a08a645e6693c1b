"""Tiny random Hugging Face checkpoints of real model families, and Hugging Face's own per-token logprobs on them.

Run by an interpreter with transformers >= 5 and torch (the vLLM environment), never imported by the test process:

    python tests/hf_reference.py OUT_DIR [--ship]

writes OUT_DIR/NAME/ (config.json as transformers saved it, model.safetensors) for every case in `CASES`, every
tensor the seeded one of `seeded_checkpoints.fixture_tensor` (so the repository ships the references without the
weights: with `--ship`, this output is also stripped into `tests/data/hf_families/`), and
OUT_DIR/reference.json: {"sequences": [[id, ...], ...], "cases": {NAME: {"logprobs": [[...], ...]}}}, where
logprobs[s][t] is log p(sequences[s][t + 1] | sequences[s][: t + 1]) under Hugging Face's eager float32 forward.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers
from seeded_checkpoints import DATA, seed_directory, strip

VOCAB = 96
SEQ_LEN = 24
MAX_POS = 128

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=MAX_POS,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

CASES: dict[str, tuple[str, dict]] = {
    # Llama 3.x: theta 500000 with llama3 frequency scaling, untied (8B) and tied (3.2 1B) embeddings.
    "llama3": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "llama_tied": (
        "LlamaConfig",
        dict(tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=500000.0)),
    ),
    # YaRN with the scaling keys Levanter computes (Qwen2.5 / DeepSeek-style long context).
    "llama_yarn": (
        "LlamaConfig",
        dict(
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=32,
                beta_fast=32.0,
                beta_slow=1.0,
            ),
        ),
    ),
    "llama_dynamic": (
        "LlamaConfig",
        dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)),
    ),
    # Qwen2.5: qkv bias, tied embeddings, theta 1e6, no sliding window in use.
    "qwen2": (
        "Qwen2Config",
        dict(
            tie_word_embeddings=True,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        ),
    ),
    # Qwen3: qk-norm, an explicit head_dim larger than hidden/heads, tied embeddings.
    "qwen3": (
        "Qwen3Config",
        dict(
            head_dim=64,
            tie_word_embeddings=True,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        ),
    ),
    # OLMo 2: qk-norm over the whole projection, post-norms, untied.
    "olmo2": (
        "Olmo2Config",
        dict(tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=500000.0)),
    ),
    # Mistral v0.3: no sliding window.
    "mistral": (
        "MistralConfig",
        dict(sliding_window=None, tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
    ),
    # Mistral v0.1: a 4096 window, longer than any sequence here (so it changes nothing).
    "mistral_window_4096": (
        "MistralConfig",
        dict(sliding_window=4096, tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1e4)),
    ),
    "mistral_window_8": (
        "MistralConfig",
        dict(sliding_window=8, tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1e4)),
    ),
    "mistral_head_dim": (
        "MistralConfig",
        dict(head_dim=64, sliding_window=None, rope_parameters=dict(rope_type="default", rope_theta=1e6)),
    ),
    # Mixture-of-experts families: Qwen3-MoE (qk-norm, head_dim, 4 experts, top 2) and Mixtral (4 experts, top 2).
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            head_dim=64,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        ),
    ),
    # Gemma 2 without final logit soft-capping (Levanter's Gemma 2 head does not apply it); attention soft-capping,
    # a window longer than the context, query_pre_attn_scalar = head_dim.
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=32,
            query_pre_attn_scalar=32,
            final_logit_softcapping=None,
            attn_logit_softcapping=50.0,
            sliding_window=4096,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # Gemma 2 as released: final soft-capping 30 (refused).
    "gemma2_release": (
        "Gemma2Config",
        dict(
            head_dim=32,
            query_pre_attn_scalar=32,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
            sliding_window=4096,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # Gemma 3 with one rotary base on the sliding and the global layers (Levanter's Gemma 3 has one).
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=4096,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            rope_parameters=dict(
                full_attention=dict(rope_type="default", rope_theta=1e4),
                sliding_attention=dict(rope_type="default", rope_theta=1e4),
            ),
        ),
    ),
    # Gemma 3 as released: global base 1e6, local 1e4 (refused).
    "gemma3_release": (
        "Gemma3TextConfig",
        dict(
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=4096,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            rope_parameters=dict(
                full_attention=dict(rope_type="default", rope_theta=1e6),
                sliding_attention=dict(rope_type="default", rope_theta=1e4),
            ),
        ),
    ),
}


def _seeded_checkpoint(model: torch.nn.Module, path: Path, case: str) -> torch.nn.Module:
    """Save `model` at `path` with every tensor of its file replaced by the seeded one (`fixture_tensor`: off the
    initial norm scales of one and zero biases, so that a loader that drops or misplaces a tensor cannot agree by
    accident), and load it back as transformers loads a checkpoint (experts fused or not, a tied head)."""
    model.save_pretrained(path)
    seed_directory(path, case)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    unused = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not unused, f"{case}: {unused}"
    return loaded.eval()


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, VOCAB, (SEQ_LEN,), generator=gen).tolist() for _ in range(3)]
    ids = torch.tensor(sequences)
    cases = {}
    for name, (cls_name, extra) in CASES.items():
        kwargs = {**_COMMON, **extra}
        if cls_name == "Qwen2Config":
            kwargs.setdefault("attention_bias", True)  # transformers' Qwen2 always has qkv biases
        config = getattr(transformers, cls_name)(**kwargs)
        config._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model = _seeded_checkpoint(model, out / name, name)
        try:
            with torch.no_grad():
                logits = model(ids).logits.float()
        except Exception as e:  # noqa: BLE001 - a configuration transformers itself cannot run is reported, not fatal
            cases[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        lp = torch.log_softmax(logits, dim=-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        cases[name] = {"logprobs": lp.tolist()}
    info = {"transformers": transformers.__version__, "torch": torch.__version__}
    (out / "reference.json").write_text(json.dumps({"sequences": sequences, "cases": cases, "versions": info}))


def ship(out: Path) -> None:
    """Replace the shipped references (`tests/data/hf_families/`) with the checkpoints and logprobs at `out`."""
    shipped = DATA / "hf_families"
    if shipped.exists():
        shutil.rmtree(shipped)
    for case in sorted(p for p in out.iterdir() if p.is_dir()):
        strip(case, shipped / case.name, case.name)
    shutil.copy(out / "reference.json", shipped / "reference.json")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    if "--ship" in sys.argv[2:]:
        ship(Path(sys.argv[1]))
