"""Reusing a warm start: the weights an identical earlier warm start produced, instead of training them again.

A warm start (`learner.warm_start`) is deterministic: the same initial weights, demonstrations, settings, device
layout and code give the same weights, bit for bit. So its result is stored under `learner.warm_start.cache_dir`,
keyed by a digest of everything it depends on, and an identical warm start later (a rerun with other RL settings, a
sweep, a replaced learner, the test suite's many runs of one experiment) loads it in a fraction of a second:

- the initial weights themselves (their bytes, dtypes and shapes: the model config, its seed, an HF checkpoint),
  and the model config's text (settings that change the forward pass but no weight);
- the demonstrations (token ids), `max_seq_len`, the seed and the warm start's settings;
- the device layout (platform, device kind and count, the mesh and its axis mappings);
- the code: the versions of JAX, jaxlib, Levanter, haliax, equinox, optax and NumPy, and a digest of marin_rl's own
  source files, so an edited checkout never reuses a result its old code produced.

Only single-process learners whose weights fit `cache_max_mb` use it. An entry is one file (the weights as equinox
serialises them, and the loss curve), written to a temporary name and renamed, so a reader never sees half of one;
an entry that cannot be read is recomputed and overwritten.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import io
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import equinox as eqx
import fsspec
import jax
import numpy as np

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
"""Bumped when an entry's layout changes."""

_VERSIONED = ("jax", "jaxlib", "marin-levanter", "marin-haliax", "levanter", "haliax", "equinox", "optax", "numpy")


@functools.cache
def source_digest() -> str:
    """SHA-256 of marin_rl's Python source files (their paths and contents)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def library_versions() -> dict[str, str]:
    """Installed versions of the libraries a warm start's numbers depend on."""
    out = {}
    for name in _VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def _update_with_arrays(h: Any, tree: Any) -> None:
    for leaf in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array)):
        a = np.asarray(leaf)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())


def cache_key(
    model: Any,
    model_config_text: str,
    examples: list[tuple[list[int], list[int]]],
    settings: dict[str, Any],
    layout: dict[str, Any],
) -> str:
    """The digest naming a warm start's result: of the initial `model`'s arrays, the model config's text, the
    demonstrations, the warm start's `settings` (steps, learning rate, rows, max_seq_len, seed), the device `layout`,
    the library versions and marin_rl's source."""
    h = hashlib.sha256()
    head = {
        "format": CACHE_FORMAT,
        "model_config": model_config_text,
        "settings": settings,
        "layout": layout,
        "versions": library_versions(),
        "source": source_digest(),
    }
    h.update(json.dumps(head, sort_keys=True, default=str).encode())
    for prompt, completion in examples:
        h.update(np.asarray(prompt, np.int64).tobytes() + b"|" + np.asarray(completion, np.int64).tobytes() + b";")
    _update_with_arrays(h, model)
    return h.hexdigest()


def entry_path(cache_dir: str, key: str) -> str:
    """Where the entry for `key` lives under `cache_dir` (a local path, `~` expanded, or an fsspec URL)."""
    root = cache_dir if "://" in cache_dir else os.path.expanduser(cache_dir)
    return f"{root.rstrip('/')}/{key[:2]}/{key}.eqx"


def load(path: str, like: Any) -> tuple[Any, dict[str, Any]] | None:
    """(the weights shaped like `like`, the stored result) of the entry at `path`; None when there is none or it
    cannot be read (logged)."""
    try:
        fs, p = fsspec.core.url_to_fs(path)
        if not fs.exists(p):
            return None
        with fs.open(p, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            result = json.loads(f.read(header_len))
            return eqx.tree_deserialise_leaves(f, like), result
    except Exception as e:  # a truncated or foreign file: recompute (and overwrite it)
        name = type(e).__name__
        logger.warning("warm start cache: could not read %s (%s: %s); training the warm start", path, name, e)
        return None


def save(path: str, model: Any, result: dict[str, Any]) -> None:
    """Store `model`'s weights and `result` (JSON-serialisable) at `path`, atomically where the filesystem renames
    atomically. Failures are logged, never raised: the cache only saves time."""
    try:
        buf = io.BytesIO()
        header = json.dumps(result).encode()
        buf.write(len(header).to_bytes(8, "little") + header)
        eqx.tree_serialise_leaves(buf, model)
        fs, p = fsspec.core.url_to_fs(path)
        fs.makedirs(os.path.dirname(p), exist_ok=True)
        tmp = f"{p}.{uuid.uuid4().hex}.tmp"
        with fs.open(tmp, "wb") as f:
            f.write(buf.getvalue())
        fs.mv(tmp, p)
    except Exception as e:
        logger.warning("warm start cache: could not write %s (%s: %s)", path, type(e).__name__, e)
