import gc
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="session")
def _run_from_repo_root():
    """Tests refer to experiments/ by relative path, as a user would from the repository root."""
    previous = os.getcwd()
    os.chdir(ROOT)
    yield
    os.chdir(previous)


def _memory_mappings() -> int:
    with open(f"/proc/{os.getpid()}/maps") as f:
        return sum(1 for _ in f)


def _max_memory_mappings() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except OSError:
        return None


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Frees the XLA programs a test module compiled once the module is done.

    Every compiled program keeps a few memory mappings of JIT code for as long as JAX's caches hold it, and the
    caches outlive the tests' models and functions. One process running the whole suite passed the kernel's limit on
    mappings per process (`vm.max_map_count`, 65,530 by default) near its end, where XLA's CPU compiler could no
    longer map code ('LLVM compilation error: Cannot allocate memory') and the process died with SIGSEGV. No module
    reuses another's programs, so their caches are cleared between modules (measured: ~10,000 mappings after the
    critic's or the learner's tests, ~1,300 after clearing). A module that alone comes near the limit is an error
    here, named, instead of a crash later."""
    yield
    if "jax" not in sys.modules or not os.path.exists(f"/proc/{os.getpid()}/maps"):
        return
    import jax

    jax.clear_caches()
    gc.collect()
    limit = _max_memory_mappings()
    if limit is not None and _memory_mappings() > limit // 2:
        pytest.fail(
            f"{_memory_mappings()} memory mappings are left after clearing JAX's caches, over half of "
            f"vm.max_map_count={limit}: something keeps compiled programs alive between test modules"
        )
