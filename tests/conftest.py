import fcntl
import gc
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "exclusive: runs while no other test of the suite runs (wall-clock bounds, or checks of machine-wide state "
        "such as every Ray process or /dev/shm); others run two at a time under pytest-xdist",
    )


# About how many seconds each of the suite's longest files took in a full run on two workers (2-core x86 VM,
# 2026-11-26, from `--durations`). Under `--dist loadfile` a file is one unit of work and xdist hands the units out in
# the order given (`--no-loadscope-reorder`; by default it orders them by their number of tests, which put these,
# most with few tests, last, and left one worker idle at the end while the other ran the longest file). Longest first
# lets the two workers finish together. Only the order depends on these figures; unlisted files follow in
# collection order.
FILE_SECONDS = {
    "test_benchmarks.py": 600,
    "test_agent_env.py": 400,
    "test_local_backend.py": 300,
    "test_bpe_tokenizer.py": 260,
    "test_reward_model.py": 260,
    "test_multihost.py": 260,
    "test_resume.py": 220,
    "test_hf_families.py": 220,
    "test_faults.py": 200,
    "test_envs_terminal.py": 110,
    "test_lora.py": 160,
    "test_vllm.py": 150,
    "test_sft.py": 120,
    "test_api.py": 100,
    "test_quickstart.py": 100,
    "test_gcs.py": 90,
    "test_curriculum.py": 80,
    "test_sharding.py": 80,
    "test_vllm_run.py": 70,
    "test_distillation.py": 60,
    "test_two_nodes.py": 60,
    "test_topk_distillation.py": 50,
}


def pytest_collection_modifyitems(session, config, items):
    """Longest files first (`FILE_SECONDS`), each file's tests kept together and in their order."""
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
    items.sort(key=lambda item: (-FILE_SECONDS.get(item.path.name, 0), first[item.path]))


@contextmanager
def _suite_turn(exclusive: bool):
    """Take this test's turn among the suite's parallel workers: shared for most tests, alone for `exclusive` ones.

    One lock file per suite run (`PYTEST_XDIST_TESTRUNUID`, the same in every worker) is held shared by a running
    test and exclusively by an `exclusive` one. A turnstile taken first gives a waiting exclusive test priority:
    while it waits, no new shared turn starts, so it waits only for the tests already running."""
    uid = os.environ["PYTEST_XDIST_TESTRUNUID"]
    base = os.path.join(tempfile.gettempdir(), f"marin_rl-suite-{uid}")
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist (the suite's default, `-n 2`) every test, its fixtures' set-up and tear-down included, runs
    inside its turn (`_suite_turn`); without it, tests run one at a time as usual."""
    if "PYTEST_XDIST_TESTRUNUID" not in os.environ:
        yield
        return
    with _suite_turn(item.get_closest_marker("exclusive") is not None):
        yield


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
