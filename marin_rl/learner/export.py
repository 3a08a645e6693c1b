"""The learner's policy as a Hugging Face checkpoint (and, with LoRA, its adapters in PEFT's format)."""

from __future__ import annotations

import contextlib
import tempfile
from typing import Any

import fsspec

from marin_rl.learner.distributed import is_primary
from marin_rl.learner.sharding import Sharding
from marin_rl.model import lora
from marin_rl.model.config import LoraConfig
from marin_rl.model.hf import export_hf_checkpoint


def export_hf(
    model: Any, path: str, tokenizer, sharding: Sharding, lora_config: LoraConfig, base_hf: str | None
) -> str:
    """Save `model` and `tokenizer` as a Hugging Face checkpoint at `path` (local or fsspec URL); returns `path`.

    A multi-host learner gathers the policy on every process (each must call this), but only process 0 writes
    `path`: Levanter's converter writes every file on every process, and two processes writing one directory race
    (one read the other's half-written tokenizer_config.json). The others write to a scratch directory that is
    removed.

    With LoRA, `path` holds the merged policy (loadable as any checkpoint), `path/peft` the adapters in PEFT's format
    and `path/base` the base they apply to, unless `base_hf` (the unchanged `model.init_from_hf`) names it."""
    with sharding.context():  # a sharded policy is gathered under its own mesh
        with contextlib.ExitStack() as stack:
            root = path
            if not is_primary():
                root = stack.enter_context(tempfile.TemporaryDirectory(prefix="marin_rl_hf_scratch_"))
            export_hf_checkpoint(lora.merged(model), tokenizer, root)
            if lora.has_adapters(model):
                export_peft(model, root, tokenizer, lora_config, base_hf)
        return path


def export_peft(model: Any, root: str, tokenizer, lora_config: LoraConfig, base_hf: str | None) -> None:
    """The adapters of `model` at `root/peft` (PEFT's format), naming their base: `base_hf` when given, else
    `root/base`, written here."""
    base = base_hf
    if base is None:
        base = export_hf_checkpoint(lora.without_adapters(model), tokenizer, f"{root}/base")
    with tempfile.TemporaryDirectory(prefix="marin_rl_peft_") as local:
        lora.save_peft(model, lora_config, local, base, tokenizer)
        fs, target = fsspec.core.url_to_fs(f"{root}/peft")
        fs.put(f"{local}/", target, recursive=True)
