"""A Hugging Face checkpoint's config.json, read in either layout and checked against what Levanter can honour.

transformers 4.x writes the rotary settings as top-level `rope_theta` and `rope_scaling` ({"rope_type" or "type",
scaling keys}); transformers 5.x writes them as `rope_parameters` ({"rope_type", "rope_theta", scaling keys}, or one
such dict per layer type, `full_attention` / `sliding_attention`, for Gemma 3). The project's transformers (4.x)
ignores `rope_parameters` and would silently fall back to its default base, so `normalised_hf_config` rewrites a
config into the 4.x layout that Levanter's `from_hf_config` reads.

`unhonoured_setting` then names any setting that the chosen Levanter architecture would run differently from
Hugging Face (a rotary type Levanter lacks, a sliding window shorter than the context on a family that attends over
everything, a soft-cap Levanter does not apply, ...): such a checkpoint is refused, never loaded with a silently
different configuration. `architecture_from_hf` derives the Levanter architecture of a checkpoint and checks, by a
round trip back to an HF config, that it describes the same network.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import fsspec
from levanter.compat.hf_checkpoints import HFCompatConfig
from levanter.models.lm_model import LmConfig

_ROPE_TYPES = ("default", "llama3", "yarn")
"""Rotary types Levanter's `RotaryEmbeddingsConfig` computes as transformers does and writes back into an HF config
(its 'linear' scaling computes, but is written back without its type, which transformers 4.x rejects)."""

_ROPE_KEYS = {
    "default": set(),
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "truncate"},
}
"""The scaling keys each rotary type may carry; Levanter ignores any other (yarn's `attention_factor`, `mscale`,
`mscale_all_dim`), so a checkpoint setting one is refused."""

_FAMILIES = {
    "llama": ("levanter.models.llama", "LlamaConfig"),
    "mistral": ("levanter.models.mistral", "MistralConfig"),
    "mixtral": ("levanter.models.mixtral", "MixtralConfig"),
    "qwen2": ("levanter.models.qwen", "QwenConfig"),
    "qwen3": ("levanter.models.qwen", "Qwen3Config"),
    "qwen3_moe": ("levanter.models.qwen3_moe", "Qwen3MoeConfig"),
    "olmo2": ("levanter.models.olmo", "Olmo2Config"),
    "olmo3": ("levanter.models.olmo3", "Olmo3Config"),
    "gemma": ("levanter.models.gemma", "GemmaConfig"),
    "gemma2": ("levanter.models.gemma", "Gemma2Config"),
    "gemma3_text": ("levanter.models.gemma", "Gemma3Config"),
}
"""HF `model_type` -> the Levanter architecture that loads it."""

_WINDOWED_FAMILIES = frozenset({"qwen2", "qwen3", "qwen3_moe"})
"""Families whose sliding window applies only when `use_sliding_window` is true."""

_EXPERTS_NAMED_NUM_EXPERTS = frozenset({"qwen2_moe", "qwen3_moe"})
"""Families whose 4.x config names the expert count `num_experts` (5.x: `num_local_experts`)."""

_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0}
"""transformers' values for yarn keys a config leaves out (an `mscale` without `mscale_all_dim` has no effect there,
so 1.0, under which Levanter's temperature equals transformers' default attention factor)."""

_PASSED_THROUGH = ("head_dim", "sliding_window", "use_sliding_window", "query_pre_attn_scalar")
"""Levanter fields some `from_hf_config`s leave at their defaults although the HF config sets them."""

_NOT_COMPARED = frozenset(
    {
        "architectures",
        "auto_map",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "_name_or_path",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "vocab_size",
        "max_position_embeddings",  # Levanter writes its seq_len here; the run raises it to its own max_seq_len
        "initializer_range",
        "attention_dropout",
        "layer_types",
        "max_window_layers",
        "sliding_window",
        "use_sliding_window",
        "_sliding_window_pattern",
        "sliding_window_pattern",
        "rope_local_base_freq",
        "head_dim",
        "decoder_start_token_id",
        "begin_suppress_tokens",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)
"""Keys the round trip does not compare: metadata, initialisation, and settings `unhonoured_setting` checks itself
(windows, Gemma 3's local rotary base, the head size)."""


def read_config_json(path: str) -> dict[str, Any]:
    """The parsed config.json of the HF checkpoint at `path` (a local directory or an fsspec URL)."""
    with fsspec.open(f"{path.rstrip('/')}/config.json", "r") as f:
        return json.load(f)


def levanter_family(model_type: str) -> type[HFCompatConfig]:
    """The Levanter architecture class for an HF `model_type`; ValueError when there is none."""
    import importlib

    if model_type not in _FAMILIES:
        raise ValueError(f"model_type: {model_type!r} has no Levanter architecture here (known: {sorted(_FAMILIES)})")
    module, name = _FAMILIES[model_type]
    return getattr(importlib.import_module(module), name)


def _flat_rope(params: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling in the 4.x layout) of one 5.x `rope_parameters` dict."""
    if "rope_theta" not in params:
        raise ValueError(f"{where}.rope_theta: missing")
    rest = {k: v for k, v in params.items() if k != "rope_theta"}
    if rest.get("rope_type", "default") == "default" and set(rest) <= {"rope_type"}:
        return float(params["rope_theta"]), None
    return float(params["rope_theta"]), rest


def normalised_hf_config(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` (a config.json of either layout) in the 4.x layout: top-level `rope_theta`, `rope_scaling` with a
    `rope_type` key (or None), Gemma 3's `rope_local_base_freq`; `rope_parameters` removed. Raises ValueError naming
    the key when the two layouts are both present and disagree."""
    cfg = dict(raw)
    if cfg.get("model_type") in _EXPERTS_NAMED_NUM_EXPERTS and "num_local_experts" in cfg:
        # transformers 5.x writes Qwen's expert count as `num_local_experts`; 4.x (and Levanter) read `num_experts`.
        local = cfg.pop("num_local_experts")
        if cfg.setdefault("num_experts", local) != local:
            raise ValueError(f"num_experts: {cfg['num_experts']} disagrees with num_local_experts {local}")
    params = cfg.pop("rope_parameters", None)
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict) and "rope_type" not in scaling and "type" in scaling:
        scaling = {("rope_type" if k == "type" else k): v for k, v in scaling.items()}
        cfg["rope_scaling"] = scaling
    if params is None:
        return cfg
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters: expected a mapping, got {params!r}")
    if "full_attention" in params or "sliding_attention" in params:
        theta, new_scaling = _flat_rope(params.get("full_attention") or params["sliding_attention"], "rope_parameters")
        local = params.get("sliding_attention")
        if local is not None:
            local_theta, local_scaling = _flat_rope(local, "rope_parameters.sliding_attention")
            if local_scaling is not None:
                raise ValueError(
                    f"rope_parameters.sliding_attention.rope_type: {local_scaling.get('rope_type')!r} on the sliding "
                    "layers is not supported (Levanter scales only the global rotary embedding)"
                )
            cfg["rope_local_base_freq"] = local_theta
    else:
        theta, new_scaling = _flat_rope(params, "rope_parameters")
    old_theta = cfg.get("rope_theta")
    if old_theta is not None and not math.isclose(float(old_theta), theta, rel_tol=1e-9):
        raise ValueError(f"rope_theta: the top-level {old_theta} disagrees with rope_parameters' {theta}")
    if scaling is not None and new_scaling is not None and scaling != new_scaling:
        raise ValueError(f"rope_scaling: the top-level {scaling} disagrees with rope_parameters' {new_scaling}")
    cfg["rope_theta"] = theta
    cfg["rope_scaling"] = new_scaling if new_scaling is not None else scaling
    return cfg


def _effective_window(cfg: dict[str, Any]) -> int | None:
    """The sliding window transformers applies to at least one layer, or None when every layer sees everything."""
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if cfg.get("model_type") in _WINDOWED_FAMILIES and not cfg.get("use_sliding_window", False):
        return None
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and "sliding_attention" not in layer_types:
        return None
    return int(window)


def unhonoured_setting(cfg: dict[str, Any], max_seq_len: int) -> str | None:
    """`key: reason` for the first setting of the normalised HF config `cfg` that Levanter's architecture for its
    model type would not run as transformers does on sequences of up to `max_seq_len` positions; None if all are."""
    model_type = cfg.get("model_type")
    scaling = cfg.get("rope_scaling")
    if scaling is not None:
        rope_type = scaling.get("rope_type", "default")
        if rope_type not in _ROPE_TYPES:
            return f"rope_type: {rope_type!r} is not supported (Levanter computes {', '.join(_ROPE_TYPES)})"
        neutral = set()
        if rope_type == "yarn" and scaling.get("mscale") == 1.0 and "mscale_all_dim" not in scaling:
            # Levanter's yarn export writes mscale 1.0: its attention temperature then equals transformers', which
            # ignores an mscale given without mscale_all_dim
            neutral.add("mscale")
        extra = sorted(set(scaling) - {"rope_type"} - _ROPE_KEYS[rope_type] - neutral)
        if extra:
            return f"rope_scaling.{extra[0]}: not applied by Levanter's {rope_type!r} rotary embedding"
        if rope_type == "yarn" and scaling.get("truncate", True) is not True:
            return "rope_scaling.truncate: only the default (true) is computed by Levanter's yarn rotary embedding"
        if model_type in ("mistral", "mixtral"):
            return f"rope_scaling: {rope_type!r} scaling is dropped by Levanter's {model_type} architecture"
    partial = cfg.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        return f"partial_rotary_factor: {partial} (Levanter rotates the whole head)"
    window = _effective_window(cfg)
    if window is not None and window < max_seq_len:
        return (
            f"sliding_window: {window} tokens is shorter than the context of {max_seq_len} positions, and Levanter's "
            f"{model_type} attends over the whole context"
        )
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        value = cfg.get(key)
        honoured = model_type == "gemma2" and key == "attn_logit_softcapping"
        if value is not None and not honoured:
            return f"{key}: {value} is not applied by Levanter's {model_type} architecture"
    if model_type == "qwen2" and cfg.get("attention_bias", True) is not True:
        return "attention_bias: false (Levanter's Qwen2 always has query, key and value biases)"
    if model_type == "qwen2" and cfg.get("no_bias", True) is not True:
        # Levanter's own key (its Qwen export writes it): false gives the MLP biases transformers' Qwen2 lacks
        return "no_bias: false (Levanter's Qwen2 would add MLP biases that transformers' Qwen2 does not have)"
    if model_type in ("gemma2", "gemma3_text"):
        scalar, head_dim = cfg.get("query_pre_attn_scalar"), cfg.get("head_dim")
        if scalar is not None and head_dim is not None and scalar != head_dim:
            return f"query_pre_attn_scalar: {scalar} (Levanter scales attention scores by 1/sqrt(head_dim={head_dim}))"
    if model_type == "gemma3_text":
        local = cfg.get("rope_local_base_freq")
        layer_types = cfg.get("layer_types") or []
        if "sliding_attention" in layer_types and local is not None and local != cfg.get("rope_theta"):
            return (
                f"rope_local_base_freq: {local} on the sliding layers differs from rope_theta {cfg.get('rope_theta')} "
                "(Levanter's Gemma 3 uses one rotary base in every layer)"
            )
    return None


def _compared(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in _NOT_COMPARED and not k.startswith("_")}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


def _head_size(arch: HFCompatConfig) -> int | None:
    """The head size Levanter's attention layers are built with (some families ignore a `head_dim` field)."""
    if hasattr(arch, "attention_config"):
        return arch.attention_config().head_size
    size = getattr(getattr(arch, "HeadSize", None), "size", None)
    return size


def unread_setting(arch: HFCompatConfig, cfg: dict[str, Any]) -> str | None:
    """`key: reason` for a setting of the normalised HF config `cfg` that the HF config class `arch` converts
    through (transformers 4.x's) does not define, so that Levanter would never read it; None if there is none.
    Unset (null or false) settings, keys Levanter's own export writes, and those checked elsewhere (`head_dim`
    against the built head size, Qwen2's `attention_bias` and `no_bias` in `unhonoured_setting`) are not counted."""
    written = arch.to_hf_config(int(cfg.get("vocab_size") or 0))
    # Levanter's own keys (its exports write them: Qwen3's `no_bias`, Gemma 3's `use_qk_norm`) are compared by
    # value in `round_trip_differences` instead
    hf_class = type(written)
    known = set(hf_class().to_dict()) | set(written.to_dict())
    checked = {"head_dim"} | ({"attention_bias", "no_bias"} if cfg.get("model_type") == "qwen2" else set())
    unknown = sorted(k for k in set(_compared(cfg)) - known - checked if cfg[k] not in (None, False))
    if not unknown:
        return None
    key = unknown[0]
    return (
        f"{key}: {cfg[key]!r} is not a setting of transformers 4.x's {hf_class.__name__}, so Levanter would ignore it"
    )


def round_trip_differences(arch: HFCompatConfig, cfg: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint value, Levanter value) for every key of the normalised HF config `cfg` that
    `arch.to_hf_config` writes differently, and for the head size: where the network `arch` builds differs from
    the checkpoint's."""
    vocab_size = int(cfg.get("vocab_size") or 0)
    back = arch.to_hf_config(vocab_size)
    # Keys the checkpoint leaves out take the HF class's defaults, as in transformers.
    full = type(back)(**cfg).to_dict()
    back = back.to_dict()
    out = []
    head = _head_size(arch)
    if cfg.get("head_dim") is not None and head is not None and head != cfg["head_dim"]:
        out.append(("head_dim", cfg["head_dim"], head))
    for side in (full, back):
        scaling = side.get("rope_scaling")
        if isinstance(scaling, dict) and scaling.get("rope_type") == "yarn":
            side["rope_scaling"] = {**_YARN_DEFAULTS, **{k: v for k, v in scaling.items() if k != "truncate"}}
    for key in sorted(set(_compared(full)) & set(_compared(back))):
        if not _same(full[key], back[key]):
            out.append((key, full[key], back[key]))
    return out


def architecture_from_hf(path: str, max_seq_len: int | None = None) -> LmConfig:
    """The Levanter architecture of the HF checkpoint at `path`, with `max_seq_len` positions (None: the
    checkpoint's `max_position_embeddings`). Raises ValueError naming the key when a setting cannot be honoured or
    the derived architecture would describe a different network."""
    from marin_rl.gguf import hf_directory

    what = f"model.init_from_hf={path!r}"
    try:
        cfg = normalised_hf_config(read_config_json(hf_directory(path)))
        family = levanter_family(cfg.get("model_type"))
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from e
    seq_len = max_seq_len or int(cfg.get("max_position_embeddings") or 0)
    problem = unhonoured_setting(cfg, seq_len)
    if problem:
        raise ValueError(f"{what}: {problem}")
    problem = unread_setting(family(), cfg)
    if problem:
        raise ValueError(f"{what}: {problem}")
    hf_class = type(family().to_hf_config(int(cfg.get("vocab_size") or 0)))
    arch = family.from_hf_config(hf_class(**cfg))
    names = {f.name for f in dataclasses.fields(arch)}
    updates = {k: cfg[k] for k in _PASSED_THROUGH if k in names and k in cfg and cfg[k] is not None}
    if "sliding_window" in names and cfg.get("sliding_window", 0) is None:
        updates["sliding_window"] = None
    if cfg.get("model_type") == "gemma2":
        updates.update({k: cfg.get(k) for k in ("final_logit_softcapping", "attn_logit_softcapping")})
    if "tie_word_embeddings" in names:
        updates["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
    updates["max_seq_len"] = seq_len
    arch = dataclasses.replace(arch, **updates)
    diffs = round_trip_differences(arch, cfg)
    if diffs:
        key, theirs, ours = diffs[0]
        raise ValueError(
            f"{what}: {key}: Levanter's {type(arch).__name__} cannot represent {theirs!r} (it writes {ours!r})"
        )
    return arch
