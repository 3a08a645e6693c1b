"""The interpreter that computes Hugging Face references (the vLLM environment, with torch and transformers)."""

import subprocess

import pytest


def reference_python(modules: str = "torch, transformers") -> str:
    """The vLLM environment's Python when it can import `modules`; the calling test is skipped otherwise."""
    from marin_rl.inference.vllm_env import vllm_python

    try:
        python = vllm_python(None)
    except FileNotFoundError as e:
        pytest.skip(f"no interpreter with {modules} for the reference: {e}")
    probe = subprocess.run([python, "-c", f"import {modules}"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"{python} cannot import {modules}: {probe.stderr.strip()[-300:]}")
    return python
