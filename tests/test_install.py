"""The accelerator extras install the very jax the CPU default pins, inside the range the Levanter line accepts."""

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _pins(requirements: list[str]) -> dict[str, str]:
    """name -> the exact version of every `name==version` requirement."""
    pins = {}
    for line in requirements:
        req = Requirement(line)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            pins[req.name] = exact[0]
    return pins


def test_accelerator_extras_pin_the_default_jax_with_their_plugin():
    base = _pins(PROJECT["dependencies"])
    extras = PROJECT["optional-dependencies"]
    for extra, plugin in (("cuda12", "cuda12"), ("cuda13", "cuda13"), ("tpu", "tpu")):
        (line,) = extras[extra]
        req = Requirement(line)
        assert req.name == "jax" and req.extras == {plugin}, line
        assert _pins([line]) == {"jax": base["jax"]}, f"[{extra}] pins {line}, the default pins jax=={base['jax']}"


def test_the_pinned_jax_is_in_the_range_the_levanter_line_accepts():
    base = _pins(PROJECT["dependencies"])
    (levanter_jax,) = [
        Requirement(r)
        for r in importlib.metadata.requires("marin-levanter")
        if Requirement(r).name == "jax" and Requirement(r).marker is None
    ]
    assert levanter_jax.specifier.contains(base["jax"]), (levanter_jax, base["jax"])
    assert importlib.metadata.version("jax") == base["jax"] == base["jaxlib"]
