"""The suite's two tiers (tests/README.md): every test that starts a whole run is marked as one, `slow` (the
end-to-end tier, `python -m pytest -m slow`) or `gate_run` (one of the few the default gate tier keeps), so that the
gate's time stays where tests/README.md says it is; and the gate keeps a run of every route it lists.

"Starts a whole run" is read from the source: the test, a fixture it asks for, or a function of the tests it calls
(transitively) calls `marin_rl.run.run` / `main`, builds an `Orchestrator`, or starts `python -m marin_rl.run` or a
benchmark's `--smoke` mode in a process of its own. Tests that do so but stop before the loop by design (a refused
configuration, `--help`) are listed in `STOPS_BEFORE_THE_LOOP`, each with why.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

ENTRY_MODULES = {
    "marin_rl.run": {"run", "main"},
    "marin_rl.programs.run": {"run", "main"},
    "marin_rl.orchestrator.orchestrator": {"Orchestrator"},
}
"""The in-process entry points of a whole run, by module (the program, and the shim that keeps its command's name)."""

PROCESS_ENTRIES = ("marin_rl.run", "marin_rl.programs.run", "--smoke")
"""Strings that, in a command list, start a whole run (or a benchmark's loop) in a process of its own."""

STOPS_BEFORE_THE_LOOP = {
    "test_cli.py": "every run it starts is refused or interrupted before or at its first step (bad flags, Ctrl-C)",
    "test_config_and_types.py": "`--help` and a refused configuration: the program exits before the loop",
    "test_config_validation.py": "a refused configuration: the program exits before the loop",
    "test_data_rows.py": "a data file refused at preflight: `main` exits before the loop",
    "test_run_dir_config.py": "a configuration refused against the run directory's: `main` exits before the loop",
    "test_benchmarks.py::test_every_benchmark_is_smoke_tested": "lists the benchmarks; runs none",
    "test_envs_terminal.py::test_a_run_that_needs_a_sandbox_stops_before_it_starts_without_one": (
        "a run refused at preflight (no sandbox): it stops before the loop"
    ),
}
"""Tests (a file, or a file::test) that reach an entry point but stop before a run starts, and why."""

GATE_ROUTES = {
    "the Ray backend learns (shortened)": (
        "test_lora.py",
        "test_quickstart_lora_learns_ships_only_adapters_and_a_replaced_server_gets_the_base",
    ),
    "the local backend learns": ("test_local_backend.py", "test_a_two_process_local_run_learns"),
    "SIGKILL + resume equals the uninterrupted run": (
        "test_local_backend.py",
        "test_local_run_killed_with_sigkill_resumes_exactly",
    ),
    "an in-run replacement (a server)": (
        "test_lora.py",
        "test_quickstart_lora_learns_ships_only_adapters_and_a_replaced_server_gets_the_base",
    ),
    "the chat route with token capture": (
        "test_chat_completions.py",
        "test_openai_client_calls_a_tool_and_the_session_is_captured_token_exact",
    ),
    "a LoRA version carrying only adapters": (
        "test_lora.py",
        "test_quickstart_lora_learns_ships_only_adapters_and_a_replaced_server_gets_the_base",
    ),
    "a distillation step": (
        "test_distillation.py",
        "test_a_short_distillation_run_scores_every_token_and_moves_the_student_towards_its_teacher",
    ),
    "a two-process local run": ("test_local_backend.py", "test_a_two_process_local_run_learns"),
    "vLLM's parity with transformers, where its environment exists": (
        "test_hf_families.py",
        "test_vllm_scores_every_family_as_transformers_does_where_its_environment_is_built",
    ),
}
"""Each route the gate must run end to end, and a test that runs it (at least one parameter of it in the gate)."""


def _marks(decorators: list[ast.expr]) -> set[str]:
    """The names of `pytest.mark.NAME` among `decorators` (called or not), those of parameters
    (`pytest.param(..., marks=...)`) included."""
    out = set()
    for d in decorators:
        for node in ast.walk(d):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "mark":
                out.add(node.attr)
    return out


def _module_marks(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            value = node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [node.value]
            return _marks(value)
    return set()


def _imports(body: list[ast.stmt]) -> tuple[set[str], dict[str, tuple[str, str]]]:
    """The names `body`'s own imports (not those of nested functions) bind to entry points, and to functions of other
    files of tests/ (local name -> (file, name))."""
    entries, helpers = set(), {}
    for node in body:
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                local = alias.asname or alias.name
                if alias.name in ENTRY_MODULES.get(node.module, ()):
                    entries.add(local)
                elif (TESTS / f"{node.module}.py").exists():
                    helpers[local] = (node.module, alias.name)
    return entries, helpers


class _Module:
    """One file of the suite: its functions, and the names it binds to entry points and to other files' helpers."""

    def __init__(self, path: Path):
        self.tree = ast.parse(path.read_text(), str(path))
        self.functions: dict[str, ast.FunctionDef] = {}
        self.entries, self.helpers = _imports(self.tree.body)
        for node in self.tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                        self.functions.setdefault(sub.name, sub)


_MODULES: dict[str, _Module] = {}


def _module(name: str) -> _Module:
    if name not in _MODULES:
        _MODULES[name] = _Module(TESTS / f"{name}.py")
    return _MODULES[name]


def _starts_a_run(module: str, function: str, seen: set | None = None) -> bool:
    """Whether `function` of `module` (a file of tests/) starts a whole run, itself or through what it calls or the
    fixtures it asks for."""
    seen = set() if seen is None else seen
    if (module, function) in seen:
        return False
    seen.add((module, function))
    mod = _module(module)
    node = mod.functions.get(function)
    if node is None:
        return False
    called = {a.arg for a in node.args.args}  # fixtures are asked for by name
    local_entries, local_helpers = _imports([n for n in ast.walk(node) if isinstance(n, ast.ImportFrom)])
    entries, helpers = mod.entries | local_entries, {**mod.helpers, **local_helpers}
    for sub in ast.walk(node):
        if isinstance(sub, ast.List | ast.Tuple):
            strings = {e.value for e in sub.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            if strings & set(PROCESS_ENTRIES):
                return True
        if isinstance(sub, ast.Name):
            if sub.id in entries:
                return True
            called.add(sub.id)
    for name in called:
        if name in mod.functions and _starts_a_run(module, name, seen):
            return True
        if name in helpers and _starts_a_run(*helpers[name], seen):
            return True
    return False


def _tests() -> list[tuple[str, str, set[str]]]:
    """(file, test name, its markers) of every test function of the suite."""
    out = []
    for path in sorted(TESTS.glob("test_*.py")):
        mod = _module(path.stem)
        module_marks = _module_marks(mod.tree)
        for name, node in mod.functions.items():
            if name.startswith("test_"):
                out.append((path.name, name, module_marks | _marks(node.decorator_list)))
    return out


def _exempt(file: str, name: str) -> bool:
    return file in STOPS_BEFORE_THE_LOOP or f"{file}::{name}" in STOPS_BEFORE_THE_LOOP


def test_every_test_that_starts_a_whole_run_is_marked_as_one():
    unmarked = [
        f"{file}::{name}"
        for file, name, marks in _tests()
        if _starts_a_run(file[:-3], name) and not marks & {"slow", "gate_run"} and not _exempt(file, name)
    ]
    assert not unmarked, (
        "these tests start a whole run but are marked neither `slow` (the end-to-end tier) nor `gate_run` (listed "
        f"in tests/README.md): {unmarked}"
    )


def _direct_marks(decorators: list[ast.expr]) -> set[str]:
    """The names of the `pytest.mark.NAME` decorators themselves (not those of parameters)."""
    out = set()
    for d in decorators:
        d = d.func if isinstance(d, ast.Call) else d
        if isinstance(d, ast.Attribute) and isinstance(d.value, ast.Attribute) and d.value.attr == "mark":
            out.add(d.attr)
    return out


def test_no_test_is_in_both_tiers_and_every_gate_run_is_listed_in_the_readme():
    readme = (TESTS / "README.md").read_text()
    gate_runs = []
    for file, name, marks in _tests():
        node = _module(file[:-3]).functions[name]
        direct = _direct_marks(node.decorator_list) | _module_marks(_module(file[:-3]).tree)
        assert not {"slow", "gate_run"} <= direct, f"{file}::{name} is marked both `slow` and `gate_run`"
        if "gate_run" in marks:
            gate_runs.append(f"{file}::{name}")
    assert gate_runs
    missing = [t for t in gate_runs if f"`{t}`" not in readme]
    assert not missing, f"gate runs that tests/README.md does not list: {missing}"
    section = readme.split("## The gate's end-to-end runs", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    listed = set(re.findall(r"`(test_\w+\.py::test_\w+)`", table))
    assert listed <= set(gate_runs), (
        f"tests/README.md lists as gate runs tests not marked `gate_run`: {listed - set(gate_runs)}"
    )


@pytest.mark.parametrize("route", sorted(GATE_ROUTES))
def test_the_gate_runs_every_route(route):
    """Each route of `GATE_ROUTES` has its test in the gate: a `gate_run`, or (a route that needs no whole run, such
    as the chat route's token capture) a test not marked `slow`."""
    file, name = GATE_ROUTES[route]
    found = [m for f, n, m in _tests() if (f, n) == (file, name)]
    assert found, f"{route}: {file}::{name} no longer exists"
    assert "gate_run" in found[0] or "slow" not in found[0], f"{route}: {file}::{name} is not in the gate"


def test_the_static_reading_finds_the_runs_it_should():
    """The reading above is not vacuous: it finds runs started in process (`run(...)`, an `Orchestrator`), in a process
    of their own (`python -m marin_rl.run`, a benchmark's `--smoke`), and through a helper; and it passes over functions
    that start none."""
    assert _starts_a_run("test_quickstart", "test_shortened_quickstart_learns")  # run(...)
    assert _starts_a_run(
        "test_faults", "test_a_killed_process_is_recovered_in_run_and_the_run_matches_an_uninterrupted_one"
    )
    assert _starts_a_run("test_resume", "test_run_killed_with_sigkill_and_resumed_matches_an_uninterrupted_run")
    assert _starts_a_run("test_benchmarks", "test_benchmark_smoke_mode_runs_and_prints_its_figure")
    assert _starts_a_run("test_local_backend", "_start")  # the helper, and the test through it:
    assert _starts_a_run("test_local_backend", "test_local_run_killed_with_sigkill_resumes_exactly")
    assert not _starts_a_run("deterministic_run", "final_learner_arrays")  # reads a run's checkpoint; starts none
    assert _module("test_losses").functions["test_clipped_objective_matches_formula"]
    assert not _starts_a_run("test_losses", "test_clipped_objective_matches_formula")
