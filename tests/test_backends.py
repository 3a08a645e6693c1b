"""The backend seam (`marin_rl.orchestrator.backends.Backend`): both backends provide every method and attribute the
driver uses, with parameters the protocol's calls can bind."""

from __future__ import annotations

import inspect

import pytest

from marin_rl.orchestrator.backends import Backend
from marin_rl.orchestrator.local_backend.backend import LocalBackend
from marin_rl.orchestrator.ray_backend.backend import RayBackend

PROTOCOL_METHODS = sorted(
    name for name, value in vars(Backend).items() if inspect.isfunction(value) and not name.startswith("_")
)
PROTOCOL_ATTRIBUTES = sorted(Backend.__annotations__)


def test_the_protocol_declares_what_the_driver_uses():
    assert {"start", "wait", "shutdown", "broadcast", "evaluate", "begin_checkpoint"} <= set(PROTOCOL_METHODS)
    assert {"learner", "pools", "rollouts", "learner_errors"} <= set(PROTOCOL_ATTRIBUTES)


@pytest.mark.parametrize("backend", [RayBackend, LocalBackend], ids=lambda b: b.__name__)
@pytest.mark.parametrize("method", PROTOCOL_METHODS)
def test_each_backend_provides_each_method_with_the_protocols_parameters(backend, method):
    assert callable(getattr(backend, method, None)), f"{backend.__name__} lacks {method}"
    wanted = list(inspect.signature(getattr(Backend, method)).parameters)[1:]
    params = inspect.signature(getattr(backend, method)).parameters
    names = list(params)[1:]
    assert names[: len(wanted)] == wanted, f"{backend.__name__}.{method}{inspect.signature(getattr(backend, method))}"
    extra = [params[n] for n in names[len(wanted) :]]
    assert all(p.default is not inspect.Parameter.empty for p in extra), f"{backend.__name__}.{method}: {extra}"


@pytest.mark.parametrize("backend", [RayBackend, LocalBackend], ids=lambda b: b.__name__)
def test_each_backend_sets_each_attribute(backend):
    source = inspect.getsource(backend)
    for name in PROTOCOL_ATTRIBUTES:
        assert f"self.{name} =" in source or f"self.{name}:" in source or f"    {name}" in source, (
            f"{backend.__name__} never sets {name}"
        )
