"""The package's layers import one way: every module imports only from its own layer unit or those below it, and no
set of modules imports itself in a circle. Imports inside functions and under `TYPE_CHECKING` count too.

The order (bottom first) is the one docs/architecture.md shows. A unit is a module or a package of
`marin_rl`; the programs (`marin_rl/programs/`) are the entry points, and above them only the shims that keep
each command's short name (`python -m marin_rl.run` runs `marin_rl.programs.run`).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "marin_rl"

LAYERS: list[tuple[str, list[str]]] = [
    ("start", ["deferred_imports"]),
    ("fields", ["bounds", "frozen"]),
    ("logging", ["logs"]),
    ("text", ["bpe"]),
    ("formats", ["gguf"]),
    (
        "foundation",
        [
            "types",
            "tokenizer",
            "tool_calls",
            "progress",
            "tracking",
            "report",
            "placement",
            "processes",
            "cli_help",
            "atomic_files",
            "checkpoint_dirs",
        ],
    ),
    ("model", ["model"]),
    ("replay", ["replay"]),
    ("broadcast", ["broadcast"]),
    ("inference", ["inference"]),
    ("envs", ["envs"]),
    ("learner", ["learner"]),
    ("config", ["config"]),
    ("rollouts", ["rollouts"]),
    ("api", ["api"]),
    ("orchestrator", ["orchestrator"]),
    ("programs", ["programs"]),
    ("commands", ["run", "try_env", "inspect_rollouts", "graph", "reward_model", "marin"]),
]
"""Layer units from the bottom up. Units of one layer may not import each other (they are siblings); a unit may
import itself (without cycles) and any unit of a lower layer."""


def _rank(unit: str) -> int:
    for i, (_, units) in enumerate(LAYERS):
        if unit in units:
            return i
    raise KeyError(unit)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def unit_of(module: str) -> str:
    """`marin_rl.replay.buffer` -> `replay`; `marin_rl.run` -> `run`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports_of(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported marin_rl module, line) for every import statement of module `name` (at `path`), wherever it
    stands; `from marin_rl.x import y` counts as an import of the module `marin_rl.x.y` when `known` has one."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "marin_rl"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "marin_rl":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((sub if sub in known else target, node.lineno))
    return out


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layering_violations(modules: dict[str, Path]) -> list[str]:
    """One message per import that goes upward or sideways between sibling units."""
    problems = []
    for name, path in modules.items():
        unit = unit_of(name)
        if not unit:
            continue  # marin_rl/__init__.py
        for target, line in imports_of(name, path, modules):
            tunit = unit_of(target)
            if not tunit or tunit == unit:
                continue
            if _rank(tunit) >= _rank(unit):
                where = "sideways to a sibling" if _rank(tunit) == _rank(unit) else "upward"
                problems.append(
                    f"{_shown(path)}:{line}: imports {target} ({where}: {unit!r} is in layer "
                    f"{LAYERS[_rank(unit)][0]!r}, {tunit!r} in layer {LAYERS[_rank(tunit)][0]!r})"
                )
    return problems


def import_cycles(modules: dict[str, Path]) -> list[str]:
    """One message per circle of module imports (strongly connected components of more than one module, or a
    module importing itself), naming the lines that close it."""
    edges: dict[str, list[tuple[str, int]]] = {}
    for name, path in modules.items():
        edges[name] = [(t, line) for t, line in imports_of(name, path, modules) if t in modules and t != name]
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w, _ in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    problems = []
    for comp in components:
        members = set(comp)
        lines = [f"{_shown(modules[a])}:{line} imports {b}" for a in comp for b, line in edges[a] if b in members]
        problems.append("import cycle among " + ", ".join(comp) + ":\n    " + "\n    ".join(lines))
    return problems


def test_every_unit_is_in_a_layer():
    units = {unit_of(m) for m in all_modules()} - {""}
    known = {u for _, us in LAYERS for u in us}
    assert units <= known, (
        f"modules outside every layer (add them to LAYERS and docs/architecture.md): {sorted(units - known)}"
    )


def test_imports_go_down_the_layers():
    problems = layering_violations(all_modules())
    assert not problems, "imports against the layer order:\n" + "\n".join(problems)


def test_no_import_cycles():
    problems = import_cycles(all_modules())
    assert not problems, "\n".join(problems)


BACKENDS = ("marin_rl.orchestrator.ray_backend", "marin_rl.orchestrator.local_backend")
"""The orchestrator's two backends; the shared driver reaches them only through `SEAM`."""
SEAM = "marin_rl.orchestrator.backends"


def backend_of(module: str) -> str | None:
    """The backend package a module belongs to, or None (shared code, or outside the orchestrator)."""
    return next((b for b in BACKENDS if module == b or module.startswith(b + ".")), None)


def seam_violations(modules: dict[str, Path]) -> list[str]:
    """One message per import from one backend into the other, or from anything but the seam into a backend."""
    problems = []
    for name, path in modules.items():
        own = backend_of(name)
        for target, line in imports_of(name, path, modules):
            other = backend_of(target)
            if other is None or other == own:
                continue
            if own is not None:
                problems.append(f"{_shown(path)}:{line}: imports {target} (one backend importing the other)")
            elif name != SEAM:
                problems.append(f"{_shown(path)}:{line}: imports {target} (only {SEAM} chooses a backend)")
    return problems


def test_the_two_backends_meet_only_at_the_seam():
    problems = seam_violations(all_modules())
    assert not problems, "imports across the backend seam:\n" + "\n".join(problems)


def test_the_seam_check_fails_on_a_planted_crossing(tmp_path):
    modules = _planted(
        tmp_path,
        {
            "marin_rl.orchestrator.ray_backend.planted": "from marin_rl.orchestrator.local_backend import spmd\n",
            "marin_rl.orchestrator.planted": "from marin_rl.orchestrator.ray_backend.backend import RayBackend\n",
        },
    )
    problems = seam_violations(modules)
    assert len(problems) == 2, problems
    assert "one backend importing the other" in problems[0] + problems[1]
    assert "only marin_rl.orchestrator.backends chooses a backend" in problems[0] + problems[1]


def _planted(tmp_path: Path, sources: dict[str, str]) -> dict[str, Path]:
    """The package's modules plus the given ones (written under `tmp_path`), as the checks see them."""
    modules = all_modules()
    for name, source in sources.items():
        path = tmp_path / (name.replace(".", "_") + ".py")
        path.write_text(source)
        modules[name] = path
    return modules


def test_the_checks_fail_on_a_planted_upward_import_and_cycle(tmp_path):
    before = set(layering_violations(all_modules()))
    modules = _planted(
        tmp_path, {"marin_rl.replay.planted": "def f():\n    from marin_rl.orchestrator.ray_backend import actors\n"}
    )
    problems = sorted(set(layering_violations(modules)) - before)
    assert len(problems) == 1, problems
    assert "marin_rl_replay_planted.py:2: imports marin_rl.orchestrator.ray_backend.actors (upward" in problems[0]

    modules = _planted(
        tmp_path,
        {
            "marin_rl.replay.cycle_a": "from marin_rl.replay import cycle_b\n",
            "marin_rl.replay.cycle_b": "import marin_rl.replay.cycle_a\n",
        },
    )
    assert set(layering_violations(modules)) == before
    cycles = sorted(set(import_cycles(modules)) - set(import_cycles(all_modules())))
    assert len(cycles) == 1 and "marin_rl.replay.cycle_a, marin_rl.replay.cycle_b" in cycles[0], cycles
