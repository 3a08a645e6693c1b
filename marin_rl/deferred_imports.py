"""Deferring the imports Levanter makes eagerly but a marin_rl process rarely uses: `wandb` and `datasets`.

`import levanter.models.llama` runs Levanter's package `__init__`, which imports its trackers (wandb), its data
pipeline (datasets) and more, whatever the caller needs. That costs about a CPU-second in every
process that imports marin_rl: the run program, each Ray actor (learner, servers, env workers), each subprocess. A
deferred module is a placeholder in `sys.modules` with the real module's spec and file: `import wandb` binds the
placeholder, and the first use of any of its attributes (`wandb.init`, `isinstance(x, datasets.Dataset)`, an import
of a submodule) imports the real module, which replaces the placeholder in `sys.modules`; the placeholder forwards every
later attribute read and write to it. Nothing is deferred that is already imported, and `MARIN_RL_EAGER_IMPORTS=1`
turns the deferral off. `lazy_module` gives the same placeholder for one caller's use only (not in `sys.modules`).

Levanter's progress bars (`tqdm_loggable.auto`) also import IPython (~0.4 s) to ask whether they run in a notebook. A
process that has not imported IPython is not in one; when its stdout is not a terminal either (a Ray actor, a
subprocess, a CI job), tqdm_loggable would choose its logging mode, so that mode is chosen for it here without the
question (`choose_progress_mode`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
import types

DEFERRED = ("wandb", "datasets")
"""Top-level modules deferred when marin_rl is imported (none of them is needed to train or serve)."""

EAGER_ENV = "MARIN_RL_EAGER_IMPORTS"
"""Set to 1 to import everything eagerly, as without marin_rl."""

_LOCK = threading.RLock()
_FORWARDED_DUNDERS = frozenset({"__path__", "__all__", "__version__"})
"""Dunder names whose use needs the real module (submodule imports, `import *`, version checks); other dunders
(`__warningregistry__`, `__wrapped__`, ... probed by tools that walk `sys.modules`) are answered by the placeholder
without importing."""


class DeferredModule(types.ModuleType):
    """A placeholder for a module not imported yet: imports it on first use and forwards to it from then on."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__") and name not in _FORWARDED_DUNDERS:
            raise AttributeError(name)
        return getattr(self._real(), name)

    def __setattr__(self, name: str, value) -> None:
        if name.startswith("__") and name.endswith("__"):
            super().__setattr__(name, value)
        else:
            setattr(self._real(), name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._real(), name)

    def __dir__(self):
        return dir(self._real())

    def _real(self) -> types.ModuleType:
        """The real module, imported now if it is not yet."""
        name = self.__name__
        with _LOCK:
            if sys.modules.get(name) is self:
                del sys.modules[name]
            return importlib.import_module(name)


def defer(name: str) -> bool:
    """Put a placeholder for top-level module `name` in `sys.modules`, unless it is imported already or not
    installed. Returns whether it did."""
    if "." in name:
        raise ValueError(f"only top-level modules can be deferred, not {name!r}")
    with _LOCK:
        if name in sys.modules:
            return False
        spec = importlib.util.find_spec(name)
        if spec is None:
            return False
        module = DeferredModule(name)
        module.__spec__ = spec
        module.__loader__ = spec.loader
        module.__file__ = spec.origin
        module.__package__ = name
        sys.modules[name] = module
        return True


def lazy_module(name: str) -> DeferredModule:
    """A reference to module `name` (a submodule too) that imports it on the first use of one of its attributes.
    Unlike `defer`, nothing is put in `sys.modules`: `import name` elsewhere is unaffected. For a module whose names
    a caller needs only sometimes, e.g. in annotations that are resolved when a config is parsed (`lm_model.LmConfig`
    in `marin_rl.model.config`), not when the annotating module is imported."""
    return DeferredModule(name)


def is_deferred(name: str) -> bool:
    """Whether `name` is still a placeholder (not imported yet)."""
    return isinstance(sys.modules.get(name), DeferredModule)


_TQDM_FORCE = "TQDM_LOGGABLE_FORCE"
_NOTEBOOK_ENV_VARS = ("DATALORE_AGENT_MODE", "DATALORE_HOME", "DATALORE_USER")


def choose_progress_mode() -> bool:
    """Import `tqdm_loggable.auto` in its logging mode when this process is neither in a notebook (IPython is not
    imported) nor writing to a terminal, the choice its own detection makes there, without importing IPython to make
    it. The environment is left as it was. Returns whether it did."""
    stdout = sys.stdout
    if (
        "IPython" in sys.modules
        or "tqdm_loggable.auto" in sys.modules
        or _TQDM_FORCE in os.environ
        or any(v in os.environ for v in _NOTEBOOK_ENV_VARS)
        or stdout is None
        or not hasattr(stdout, "isatty")
        or stdout.isatty()
        or importlib.util.find_spec("tqdm_loggable") is None
    ):
        return False
    os.environ[_TQDM_FORCE] = "logging"
    try:
        importlib.import_module("tqdm_loggable.auto")
    finally:
        del os.environ[_TQDM_FORCE]
    return True


def defer_unused_imports() -> None:
    """Defer `DEFERRED` and choose the progress mode (`choose_progress_mode`) unless `MARIN_RL_EAGER_IMPORTS` is
    set."""
    if os.environ.get(EAGER_ENV, "") not in ("", "0"):
        return
    for name in DEFERRED:
        defer(name)
    choose_progress_mode()
