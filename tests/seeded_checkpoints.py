"""Reference checkpoints shipped small: every tensor drawn from a seed, so the repository holds only their JSON files,
the list of their tensors, and what the reference library computed on them.

A seeded checkpoint directory is an ordinary one (config.json, model.safetensors, or PEFT's adapter_config.json and
adapter_model.safetensors) whose every tensor is `fixture_tensor(case, name, shape)`: NumPy's legacy generator (a
stream NumPy guarantees never to change) seeded by the directory's case name and the tensor's name. `strip` keeps
such a directory's small files and the list of its tensors (`tensors.json`); `materialise` writes the directory
again, bit for bit, from those alone, in the test process (no torch, no transformers 5).

Shipped references (the script that computes each says how to compute it again):
- `tests/data/hf_families/`: tiny checkpoints of real families and transformers' logprobs on them
  (`tests/hf_reference.py`, run by an interpreter with torch and transformers >= 5);
- `tests/data/peft_reference/`: a base and LoRA adapters in PEFT's format and PEFT's logprobs on them
  (`tests/peft_reference.py`).

Imported by both interpreters (the test process and the reference one): NumPy at import time, safetensors inside.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import numpy as np

DATA = Path(__file__).with_name("data")
"""Where the shipped references live."""

TENSORS = "tensors.json"
"""A stripped directory's tensors: {file name: {tensor name: shape}}, in each file's order (all float32)."""


def fixture_tensor(case: str, name: str, shape) -> np.ndarray:
    """The float32 values of tensor `name` of checkpoint `case`: N(0, 0.1²) draws, plus one for norm scales, so every
    tensor is off the values a loader could fall back to (zero biases, unit scales)."""
    rng = np.random.RandomState(zlib.crc32(f"{case}/{name}".encode()))
    values = 0.1 * rng.standard_normal(tuple(shape))
    if len(shape) == 1 and "norm" in name:
        values += 1.0
    return values.astype(np.float32)


def seed_directory(path: Path, case: str) -> None:
    """Replace every tensor of every safetensors file in `path` with its seeded value (same names, same shapes)."""
    from safetensors.numpy import load_file, save_file

    for f in sorted(Path(path).glob("*.safetensors")):
        shapes = {name: value.shape for name, value in load_file(str(f)).items()}
        save_file({n: fixture_tensor(case, n, s) for n, s in shapes.items()}, str(f), metadata={"format": "pt"})


def strip(src: Path, dst: Path, case: str) -> None:
    """Copy `src`'s files except its safetensors into `dst`, listing their tensors in `dst/tensors.json`; every tensor
    must be the seeded one (else `materialise` could not write it again)."""
    from safetensors.numpy import load_file

    dst.mkdir(parents=True, exist_ok=True)
    listing = {}
    for f in sorted(Path(src).iterdir()):
        if f.is_dir():
            continue
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
            continue
        listing[f.name] = {}
        for name, value in load_file(str(f)).items():
            want = fixture_tensor(case, name, value.shape)
            assert value.dtype == np.float32 and np.array_equal(value, want), f"{case}: {f.name}/{name} is not seeded"
            listing[f.name][name] = list(value.shape)
    (dst / TENSORS).write_text(json.dumps(listing, indent=1) + "\n")


def materialise(src: Path, dst: Path, case: str) -> Path:
    """Write the checkpoint directory that `strip` made `src` from, at `dst`, bit for bit."""
    from safetensors.numpy import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.is_file() and f.name != TENSORS:
            shutil.copy(f, dst / f.name)
    for file, shapes in json.loads((Path(src) / TENSORS).read_text()).items():
        tensors = {name: fixture_tensor(case, name, shape) for name, shape in shapes.items()}
        save_file(tensors, str(dst / file), metadata={"format": "pt"})
    return dst
