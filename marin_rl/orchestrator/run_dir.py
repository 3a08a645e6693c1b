"""A run directory remembers its configuration: `output_dir/config.yaml`, the resolved config (draccus's encoding)
of the run that last started there.

When a run resumes from a checkpoint, its config is compared with the remembered one. A difference in a field that
changes results (the model, the data, the optimizer, the loss, sampling, batch sizes, the seed, ...) stops the run
before anything starts, listing each differing field with its old and new value and the two ways on: a new
`output_dir`, or `checkpoint.resume: force`. The fields in `HARMLESS_FIELDS` may differ: where metrics go and how
often (`tracking.*`), the checkpoint cadence and retention, the evaluation cadence, `orchestrator.num_steps` (raising
it extends a finished run; lowering it ends the run at the checkpoint), where processes run (`placement.*`, Ray's
address and CPUs, the learner's hosts and mesh, gradient accumulation, the number of inference servers, the
compilation cache), restart limits and timeouts.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import draccus
import fsspec
import yaml

from marin_rl.config import RunConfig, without_secrets

logger = logging.getLogger("marin_rl")

CONFIG_FILE = "config.yaml"
"""The remembered configuration, in `output_dir`."""

HARMLESS_FIELDS = (
    "output_dir",
    "tracking.",
    "checkpoint.every",
    "checkpoint.keep",
    "checkpoint.path",
    "checkpoint.resume",
    "checkpoint.save_on_exit",
    "orchestrator.num_steps",
    "orchestrator.eval_every",
    "orchestrator.compilation_cache_dir",
    "orchestrator.ray_address",
    "orchestrator.num_cpus",
    "orchestrator.max_restarts_per_role",
    "orchestrator.local_http",
    "placement.",
    "learner.hosts",
    "learner.mesh.",
    "learner.microbatches",
    "learner.offload_optimizer",
    "inference.num_servers",
    "model.export_every",
    "inference.control_secret",
    "inference.request_timeout_s",
    "inference.health_check_every_s",
)
"""Dotted fields (a trailing '.': every field under it) that a resumed run may change: they do not change what is
trained, only where and how often things are reported, saved or placed, and how long the run goes."""

SHOWN_DIFFERENCES = 20
"""At most this many differing fields are listed in the refusal."""

UNSET = "(unset)"


class RunDirConflict(ValueError):
    """A run would resume a checkpoint written under another configuration; the message lists the fields."""


def config_dict(config: RunConfig) -> dict[str, Any]:
    """The config as its YAML file holds it (draccus's encoding, in plain JSON types; a value that has none, such as
    an object in an env's `args` given from Python, as its text), without its secrets (`SECRET_FIELDS`)."""
    return without_secrets(json.loads(json.dumps(draccus.encode(config), default=str)), None)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted field → value of a nested config dict; lists of dicts with unique `name`s (envs, reward models) are
    keyed by name (`envs[math].args.train_path`), other lists are values; an empty dict has no fields."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list) and value and all(isinstance(x, dict) and "name" in x for x in value):
        names = [str(x["name"]) for x in value]
        if len(set(names)) == len(names):
            out = {}
            for name, x in zip(names, value, strict=True):
                out.update(flatten(x, f"{prefix}[{name}]"))
            return out
    return {prefix: value}


def harmless(field: str) -> bool:
    """Whether `field` (dotted) may differ between a run and the one it resumes (`HARMLESS_FIELDS`)."""
    return any(field.startswith(h) if h.endswith(".") else field == h for h in HARMLESS_FIELDS)


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted field, old value, new value) of every field that changes results and differs, in order."""
    a, b = flatten(old), flatten(new)
    out = []
    for field in list(a) + [f for f in b if f not in a]:
        before, after = a.get(field, UNSET), b.get(field, UNSET)
        if before != after and not harmless(field):
            out.append((field, before, after))
    return out


def _show(value: Any, limit: int = 80) -> str:
    text = value if value is UNSET else json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_differences(diffs: list[tuple[str, Any, Any]]) -> str:
    """One line per differing field, 'field: old → new' (at most `SHOWN_DIFFERENCES`)."""
    lines = [f"  {field}: {_show(before)} → {_show(after)}" for field, before, after in diffs[:SHOWN_DIFFERENCES]]
    if len(diffs) > SHOWN_DIFFERENCES:
        lines.append(f"  ... and {len(diffs) - SHOWN_DIFFERENCES} more")
    return "\n".join(lines)


def config_path(config: RunConfig) -> str:
    """Where the run directory's configuration is remembered."""
    return os.path.join(config.output_dir, CONFIG_FILE)


def remembered_config(config: RunConfig) -> dict[str, Any] | None:
    """The configuration `output_dir` remembers (None when there is none)."""
    path = config_path(config)
    fs, p = fsspec.core.url_to_fs(path)
    if not fs.exists(p):
        return None
    with fsspec.open(path, "r") as f:
        return yaml.safe_load(f) or {}


def check_resume_config(config: RunConfig, resume_path: str | None) -> None:
    """Before a run resumes from `resume_path` (None: it starts fresh, nothing to check): refuse, with a
    `RunDirConflict` listing the fields, when the remembered configuration differs from `config` in a field that
    changes results; with `checkpoint.resume: force` log the differences and go on."""
    if resume_path is None:
        return
    old = remembered_config(config)
    if old is None:
        return
    diffs = differences(old, config_dict(config))
    if not diffs:
        return
    listed = format_differences(diffs)
    if config.checkpoint.resume == "force":
        logger.warning(
            "checkpoint.resume: force: resuming %s under a configuration that differs from the one it was written "
            "with in:\n%s",
            resume_path,
            listed,
        )
        return
    raise RunDirConflict(
        f"output_dir {config.output_dir} holds a run (checkpoint {resume_path}) whose configuration "
        f"({config_path(config)}) differs from this one in:\n{listed}\n"
        "Resuming would continue that run with other settings. Either start a new run with another --output_dir, "
        "or resume it anyway with --checkpoint.resume force (the new settings apply from its checkpoint on)."
    )


def remember_config(config: RunConfig) -> str:
    """Write `config` (resolved) to `output_dir/config.yaml`; returns the path."""
    path = config_path(config)
    fs, p = fsspec.core.url_to_fs(path)
    fs.makedirs(os.path.dirname(p), exist_ok=True)
    with fsspec.open(path, "w") as f:
        yaml.safe_dump(config_dict(config), f, sort_keys=False)
    return path
