import fcntl
import gc
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


GATE_BOUND_S = 60.0
"""A test that takes longer than this (set-up, call and tear-down together) without being an end-to-end run
(`slow` or `gate_run`) is named at the end of the run: the gate tier must not creep back towards an hour."""

END_TO_END = ("slow", "gate_run")
"""The markers of tests that start a whole run (tests/README.md): `slow` ones form the end-to-end tier, `gate_run`
ones are the few the gate keeps."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "exclusive: runs while no other test of the suite runs (wall-clock bounds, or checks of machine-wide state "
        "such as every Ray process or /dev/shm); others run two at a time under pytest-xdist",
    )


def _named_on_command_line(config) -> list[str]:
    """The node ids (`path::name...`) given as arguments, relative to the repository root."""
    named = []
    for arg in config.args:
        if "::" not in arg:
            continue
        path, rest = arg.split("::", 1)
        try:
            path = Path(path).resolve().relative_to(config.rootpath).as_posix()
        except ValueError:
            pass
        named.append(f"{path}::{rest}")
    return named


def _gate_tier(config, items) -> None:
    """With no `-m` expression, the run is the gate tier: tests marked `slow` are deselected, unless the command
    line names them (`python -m pytest tests/test_x.py::test_y` runs test_y whatever its tier). `-m slow` runs the
    end-to-end tier, `-m "slow or not slow"` both."""
    if config.getoption("markexpr"):
        return
    named = _named_on_command_line(config)
    keep, drop = [], []
    for item in items:
        wanted = item.get_closest_marker("slow") is None or any(item.nodeid.startswith(n) for n in named)
        (keep if wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# About how many seconds each of the longest files takes in each tier on two workers (2-core x86 VM, 2026-11-28,
# `--durations` on a fresh clone with empty caches). Under `--dist loadfile` a file is one unit of work and xdist hands
# the units out in the order given (`--no-loadscope-reorder`; by default it orders them by their number of tests,
# which put these, most with few tests, last, and left one worker idle at the end while the other ran the longest
# file). Longest first lets the two workers finish together. Only the order depends on these figures; unlisted files
# follow in collection order.
GATE_FILE_SECONDS = {
    "test_lora.py": 370,
    "test_local_backend.py": 245,
    "test_learner.py": 185,
    "test_hf_families.py": 125,
    "test_critic.py": 120,
    "test_reward_model.py": 115,
    "test_config_validation.py": 105,
    "test_api.py": 70,
    "test_sft.py": 65,
    "test_levanter_engine.py": 65,
    "test_sharding.py": 50,
    "test_chat_completions.py": 50,
    "test_distillation.py": 50,
    "test_envs_try.py": 45,
    "test_dense_engine.py": 40,
}
"""The gate tier (the default run)."""

FILE_SECONDS = {
    "test_agent_env.py": 1000,
    "test_benchmarks.py": 780,
    "test_bpe_tokenizer.py": 440,
    "test_vllm.py": 400,
    "test_multihost.py": 380,
    "test_faults.py": 350,
    "test_reward_model.py": 320,
    "test_local_backend.py": 300,
    "test_resume.py": 220,
    "test_envs_terminal.py": 210,
    "test_hf_families.py": 200,
    "test_api.py": 150,
    "test_vllm_run.py": 130,
    "test_sft.py": 120,
    "test_quickstart.py": 100,
    "test_gcs.py": 90,
    "test_curriculum.py": 80,
    "test_distillation.py": 65,
    "test_two_nodes.py": 60,
}
"""The end-to-end tier (`-m slow`), and any other `-m` selection."""


def pytest_collection_modifyitems(session, config, items):
    """The gate tier by default (`_gate_tier`); longest files first (`GATE_FILE_SECONDS`, or `FILE_SECONDS` under
    `-m`), each file's tests kept together and in their order."""
    seconds = GATE_FILE_SECONDS if not config.getoption("markexpr") else FILE_SECONDS
    _gate_tier(config, items)
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
    items.sort(key=lambda item: (-seconds.get(item.path.name, 0), first[item.path]))


_TIMES: dict[str, tuple[float, bool]] = {}
"""Each test's seconds (set-up, call and tear-down) and whether it is an end-to-end run, by node id."""


def pytest_runtest_logreport(report):
    """Adds the phase's time to `_TIMES`; under pytest-xdist this runs in the controlling process too, on the workers'
    reports, which carry each test's markers among their keywords."""
    seconds, end_to_end = _TIMES.get(report.nodeid, (0.0, False))
    _TIMES[report.nodeid] = (seconds + report.duration, end_to_end or any(m in report.keywords for m in END_TO_END))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Names every test over `GATE_BOUND_S` that is not marked as an end-to-end run, and the end-to-end runs' time."""
    times = _TIMES
    if not times or hasattr(config, "workerinput"):
        return
    over = sorted(((s, n) for n, (s, e2e) in times.items() if s > GATE_BOUND_S and not e2e), reverse=True)
    runs = sorted(((s, n) for n, (s, e2e) in times.items() if e2e), reverse=True)
    write = terminalreporter.write_line
    terminalreporter.section("suite tiers")
    write(
        f"{len(runs)} end-to-end run(s) took {sum(s for s, _ in runs):.0f} test-seconds; "
        f"all {len(times)} tests {sum(s for s, _ in times.values()):.0f}"
    )
    if over:
        write(
            f"{len(over)} test(s) took over {GATE_BOUND_S:.0f} s without an end-to-end marker (mark them `slow`, or "
            "`gate_run` and list them in tests/README.md, or make them faster):",
            yellow=True,
            bold=True,
        )
        for seconds, nodeid in over:
            write(f"  {seconds:7.1f} s  {nodeid}", yellow=True)


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
