"""The environment of the subprocesses tests start (benchmarks, the CLI, worker scripts): this checkout's package
first on `PYTHONPATH`, whether or not (and from wherever) marin_rl is installed."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The checkout's root (where `marin_rl/`, `benchmarks/` and `experiments/` are)."""
TESTS = ROOT / "tests"
"""This directory: worker scripts that import its helpers (e.g. `random_packed_batch`) need it on the path."""


def subprocess_env(*first: str | Path, **extra: str) -> dict[str, str]:
    """This process's environment with `first` (in order), then the checkout's root, before the inherited
    `PYTHONPATH`, and the variables `extra`."""
    path = os.pathsep.join([*map(str, first), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return dict(os.environ, PYTHONPATH=path, **extra)
