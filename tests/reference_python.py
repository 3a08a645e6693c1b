"""Interpreters with the libraries the tests compare against (torch, transformers >= 5, peft, vLLM).

The gate tier needs none: it checks against references shipped under `tests/data/` (`tests/seeded_checkpoints.py`).
The end-to-end tier computes them afresh, and checks vLLM, in the vLLM environment."""

import os
import subprocess

import pytest

REFERENCE_PYTHON = "MARIN_RL_REFERENCE_PYTHON"
"""An interpreter with torch and transformers >= 5 (and peft) to compute references with, instead of the vLLM
environment's."""


def _imports(python: str, modules: str) -> str | None:
    """None when `python` imports `modules`, else the end of the error it gives."""
    probe = subprocess.run([python, "-c", f"import {modules}"], capture_output=True, text=True)
    return None if probe.returncode == 0 else probe.stderr.strip()[-300:]


REFERENCE_PACKAGES = {"peft": "peft==0.21.2", "gguf": "gguf==0.19.0", "accelerate": "accelerate==1.15.0"}
"""Libraries some references are computed with that vLLM's environment does not hold, at the versions that computed
the shipped references: `reference_python` installs a missing one there (seconds; torch and transformers are vLLM's)."""


def _add_reference_packages(python: str, modules: str) -> None:
    """pip-install into the vLLM environment of `python` the `REFERENCE_PACKAGES` among `modules` that it cannot
    import, one process at a time (a lock file in the environment)."""
    import fcntl
    from pathlib import Path

    wanted = [REFERENCE_PACKAGES[m.strip()] for m in modules.split(",") if m.strip() in REFERENCE_PACKAGES]
    if not wanted or _imports(python, modules) is None:
        return
    with open(Path(python).parents[1] / ".reference_packages.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _imports(python, modules) is not None:
            done = subprocess.run([python, "-m", "pip", "install", "-q", *wanted], capture_output=True, text=True)
            if done.returncode != 0:
                pytest.fail(f"pip install {' '.join(wanted)} into {python} failed: {done.stderr.strip()[-500:]}")


def reference_python(modules: str = "torch, transformers") -> str:
    """$MARIN_RL_REFERENCE_PYTHON, else the vLLM environment's interpreter (created when missing: minutes, once per
    machine; `REFERENCE_PACKAGES` among `modules` added to it when missing). The calling test fails, naming what is
    missing, when it cannot import `modules`: a reference check never skips."""
    python = os.environ.get(REFERENCE_PYTHON)
    if not python:
        from marin_rl.inference.vllm_env import ensure_vllm_env

        python = ensure_vllm_env(quiet=True)
        _add_reference_packages(python, modules)
    error = _imports(python, modules)
    if error is not None:
        pytest.fail(f"{python} cannot import {modules} for the reference: {error}")
    return python


def built_vllm_python() -> str:
    """The vLLM environment's interpreter where it has been built; the calling test is skipped, saying how to build it,
    where it has not (vLLM is an optional backend: the end-to-end tier builds its environment and runs its checks)."""
    from marin_rl.inference.vllm_env import vllm_python

    try:
        python = vllm_python(None)
    except FileNotFoundError as e:
        pytest.skip(f"vLLM's environment is not built on this machine ({e})")
    error = _imports(python, "vllm")
    if error is not None:
        pytest.skip(f"{python} cannot import vllm: {error}")
    return python
