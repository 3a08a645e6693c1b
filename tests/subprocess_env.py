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


def run_on_cpu_devices(script: str, *args: str, devices: int = 8, timeout: float = 600) -> None:
    """Run `script` (Python source, with `args` as its `sys.argv[1:]`) in a subprocess whose JAX has `devices`
    emulated CPU devices (JAX fixes the count when it starts); fail the calling test with its stderr if it fails."""
    import subprocess
    import sys

    env = subprocess_env(TESTS, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
