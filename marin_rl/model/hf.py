"""Hugging Face checkpoints of the policy, read and written through Levanter's `HFCheckpointConverter`.

Both directions work offline: the converter is given the architecture's HF config class and a tokenizer object
directly, so it never consults the Hub. Paths may be local directories or fsspec URLs (`gs://...`, `memory://...`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import urllib.parse

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from levanter.compat.hf_checkpoints import HFCheckpointConverter, HFCompatConfig
from levanter.models.lm_model import LmConfig, LmHeadModel
from transformers import PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from marin_rl.model.hf_config import (
    normalised_hf_config,
    read_config_json,
    round_trip_differences,
    unhonoured_setting,
    unread_setting,
)

logger = logging.getLogger(__name__)


def _mesh_context() -> contextlib.AbstractContextManager:
    """The active device mesh, or else a one-device mesh on the default device (where an unsharded model lives).

    Levanter's converter shards what it loads over the mesh's `data` axis and gathers what it saves with a sharding
    constraint, both of which need a mesh in context.
    """
    from jax._src.mesh import get_concrete_mesh

    active = get_concrete_mesh()
    if active is not None and not active.empty:
        return contextlib.nullcontext()
    return hax.partitioning.set_mesh(Mesh(np.array(jax.devices()[:1]), (hax.partitioning.ResourceAxis.DATA,)))


def _hf_compat(arch: LmConfig, what: str) -> HFCompatConfig:
    if not isinstance(arch, HFCompatConfig):
        raise ValueError(f"{what}: architecture {type(arch).__name__} has no Hugging Face converter in Levanter")
    return arch


def _converter(
    arch: HFCompatConfig, vocab_size: int, reference: str, tokenizer: PreTrainedTokenizerBase
) -> HFCheckpointConverter:
    """Levanter's converter for `arch`, with `reference` as its reference checkpoint and no Hub access.

    `arch.hf_checkpoint_converter()` would fetch its default reference model's tokenizer from the Hub, so the
    converter is built here with the same class arguments, and an explicit tokenizer.
    """
    return HFCheckpointConverter(
        type(arch),
        reference_checkpoint=reference,
        HfConfigClass=type(arch.to_hf_config(vocab_size)),
        tokenizer=tokenizer,
        trust_remote_code=False,
    )


def load_hf_model(arch: LmConfig, path: str, vocab_size: int) -> LmHeadModel:
    """Load the HF checkpoint at `path` (local or fsspec URL) as a Levanter model of architecture `arch`.

    `path` may also name a GGUF file (`marin_rl.gguf.hf_directory`). Parameters are float32 whatever the
    checkpoint stores. The checkpoint's model type and architecture
    (sizes, norms, rope, tying) must match `arch`, and its vocabulary must hold the tokenizer's `vocab_size`
    tokens; a larger (padded) vocabulary is kept as it is. Raises ValueError naming what disagrees.
    """
    from marin_rl.gguf import hf_directory
    from marin_rl.tokenizer import build_char_tokenizer

    configured = path
    try:
        path = hf_directory(path)  # a GGUF file: its converted directory
    except ValueError as e:
        raise ValueError(f"model.init_from_hf={configured!r}: {e}") from None
    arch = _hf_compat(arch, f"model.init_from_hf={configured!r}")
    # The converter requires a tokenizer object, but when loading it only uses the tokenizer's size to resize the
    # vocabulary, which is disabled below; a local placeholder avoids reading (or fetching) the checkpoint's.
    converter = _converter(arch, vocab_size, path, build_char_tokenizer())
    try:
        cfg = normalised_hf_config(read_config_json(path))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model.init_from_hf={configured!r}: cannot read a Hugging Face config.json there: {e}") from e
    except ValueError as e:
        raise ValueError(f"model.init_from_hf={configured!r}: {e}") from e
    expected = arch.to_hf_config(int(cfg.get("vocab_size") or vocab_size))
    if cfg.get("model_type") != expected.model_type:
        raise ValueError(
            f"model.init_from_hf={configured!r} holds a {cfg.get('model_type')!r} model but model.architecture is "
            f"{type(arch).__name__} ({expected.model_type!r}); set model.architecture.type to match the checkpoint"
        )
    problem = unhonoured_setting(cfg, arch.max_seq_len) or unread_setting(arch, cfg)
    if problem:
        raise ValueError(f"model.init_from_hf={configured!r}: {problem}")
    diffs = round_trip_differences(arch, cfg)
    if diffs:
        raise ValueError(
            f"model.init_from_hf={configured!r} does not match model.architecture; set these fields to the "
            f"checkpoint's values: "
            + "; ".join(f"{k}: configured {ours!r} != checkpoint {theirs!r}" for k, theirs, ours in diffs)
        )
    found = type(expected)(**cfg)
    if found.vocab_size < vocab_size:
        raise ValueError(
            f"model.init_from_hf={configured!r} has a vocabulary of {found.vocab_size} tokens but the tokenizer has "
            f"{vocab_size}; use the checkpoint's own tokenizer (tokenizer.path)"
        )
    if found.vocab_size > vocab_size:
        logger.info(
            "model.init_from_hf: keeping the checkpoint's padded vocabulary of %d rows (tokenizer: %d tokens)",
            found.vocab_size,
            vocab_size,
        )
    logger.info("loading the policy from the Hugging Face checkpoint at %s", path)
    with _mesh_context():
        return converter.load_pretrained(
            arch.model_type, ref=path, config=arch, resize_vocab_to_match_tokenizer=False, dtype=jnp.float32
        )


def export_hf_checkpoint(model: LmHeadModel, tokenizer: PreTrainedTokenizerBase, path: str) -> str:
    """Save `model` and `tokenizer` as a Hugging Face checkpoint (config.json, safetensors, tokenizer files).

    `path` is a local directory or an fsspec URL (`gs://...`); it is created if needed. Parameters are saved in
    the model's dtype (float32). Returns `path`.
    """
    arch = _hf_compat(model.config, f"exporting to {path!r}")
    vocab_size = model.Vocab.size
    hf_config = arch.to_hf_config(vocab_size)
    if not getattr(hf_config, "architectures", None):
        causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type)
        if causal_lm is not None:
            hf_config.architectures = [causal_lm]
    with tempfile.TemporaryDirectory(prefix="marin_rl_hfref_") as reference:
        # The converter copies `architectures` (which transformers needs to pick the model class) from its
        # reference checkpoint's config; a local one describing this model keeps it off the Hub.
        hf_config.save_pretrained(reference)
        converter = _converter(arch, vocab_size, reference, tokenizer)
        with _mesh_context():
            converter.save_pretrained(model, path, save_reference_code=False, save_tokenizer=True)
    scheme = urllib.parse.urlparse(path).scheme
    logger.debug("exported the policy as a Hugging Face checkpoint to %s", path if scheme else os.path.abspath(path))
    return path
