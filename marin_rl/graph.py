"""Draw and list a run's algorithm: `python -m marin_rl.graph --config X [--output DIR] [dotted overrides]`.

Writes the algorithm's graph of model calls (`marin_rl.learner.algorithm`) as `DIR/<name>.dot` (Graphviz source) and
`DIR/<name>.png` (drawn with matplotlib: calls as boxes by role, data keys as ovals, the rollout side on the left;
`<name>` is `<algorithm>+<reward model>...` when the run's environments use reward models) and prints the calls in
execution order with the role, kind, side, reads and writes of each. The graph is checked first (every key read is
written upstream, roles exist, no cycle); a bad graph exits with the reason. DIR defaults to the run's `output_dir`.
"""

from __future__ import annotations

import os
import sys

from marin_rl.config import parse_config
from marin_rl.learner.algorithm import INPUTS, Algorithm, Call

ROLE_COLOURS = {
    "actor": "#9ecae1",
    "critic": "#fdae6b",
    "ref": "#c7e9c0",
    "reward": "#dadaeb",
    "env": "#eeeeee",
    "replay": "#f2f2f2",
}


def describe(algorithm: Algorithm) -> str:
    """The calls in execution order, one per line."""
    lines = [f"algorithm {algorithm.name}: {algorithm.description}", f"roles: {', '.join(algorithm.roles)}"]
    calls = algorithm.ordered()
    width = max([18, *(len(c.name) for c in calls)])
    for i, c in enumerate(calls, 1):
        lines.append(
            f"{i:>2}. {c.name:<{width}} {c.role:<7} {c.kind:<9} {c.side:<8} reads {', '.join(c.reads) or '-'}"
            f" -> writes {', '.join(c.writes)}"
        )
    return "\n".join(lines)


def to_dot(algorithm: Algorithm) -> str:
    """Graphviz source: a box per call (coloured by role, grouped by side), an oval per key, read and write edges."""
    order = algorithm.ordered()
    out = [f'digraph "{algorithm.name}" {{', "  rankdir=LR;", '  node [fontname="Helvetica"];']
    for side in ("rollout", "learner"):
        out.append(f'  subgraph "cluster_{side}" {{ label="{side} side"; style=dashed;')
        for c in (c for c in order if c.side == side):
            label = f"{c.name}\\n{c.role} · {c.kind}"
            out.append(
                f'    "{c.name}" [shape=box, style=filled, fillcolor="{ROLE_COLOURS[c.role]}", label="{label}"];'
            )
        out.append("  }")
    for key in _keys(order):
        out.append(f'  "key:{key}" [shape=ellipse, label="{key}"];')
    for c in order:
        out += [f'  "key:{k}" -> "{c.name}";' for k in c.reads]
        out += [f'  "{c.name}" -> "key:{k}";' for k in c.writes]
    out.append("}")
    return "\n".join(out) + "\n"


def _keys(order: list[Call]) -> list[str]:
    keys = list(INPUTS)
    for c in order:
        keys += [k for k in (*c.reads, *c.writes) if k not in keys]
    return keys


def draw(algorithm: Algorithm, path: str) -> str:
    """Draw the graph as a PNG at `path` (layers by dependency depth, left to right); returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = algorithm.ordered()
    depth: dict[str, int] = {f"key:{k}": 0 for k in INPUTS}
    for c in order:  # calls one column right of what they read, keys one right of their writer
        depth[c.name] = 1 + max((depth[f"key:{k}"] for k in c.reads), default=0)
        for k in c.writes:
            depth[f"key:{k}"] = depth[c.name] + 1
    columns: dict[int, list[str]] = {}
    for node, d in depth.items():
        columns.setdefault(d, []).append(node)
    pos = {n: (d, -i + (len(nodes) - 1) / 2) for d, nodes in columns.items() for i, n in enumerate(nodes)}
    width, height = 2.2 * (max(columns) + 1), 1.3 * max(len(v) for v in columns.values()) + 1.5
    fig, ax = plt.subplots(figsize=(width, height))
    edges = [(f"key:{k}", c.name) for c in order for k in c.reads] + [
        (c.name, f"key:{k}") for c in order for k in c.writes
    ]
    for a, b in edges:
        ax.annotate(
            "", xy=pos[b], xytext=pos[a], arrowprops=dict(arrowstyle="->", color="#555555", shrinkA=28, shrinkB=28)
        )
    calls = {c.name: c for c in order}
    for node, (x, y) in pos.items():
        if node in calls:
            c = calls[node]
            box = dict(
                boxstyle="round,pad=0.4", fc=ROLE_COLOURS[c.role], ec="#333333", ls="-" if c.side == "learner" else "--"
            )
            ax.text(x, y, f"{c.name}\n{c.role} · {c.kind}\n({c.side})", ha="center", va="center", fontsize=8, bbox=box)
        else:
            ax.text(
                x,
                y,
                node[4:],
                ha="center",
                va="center",
                fontsize=8,
                style="italic",
                bbox=dict(boxstyle="ellipse,pad=0.3", fc="white", ec="#888888"),
            )
    ax.set_xlim(-0.7, max(columns) + 0.7)
    ax.set_ylim(min(y for _, y in pos.values()) - 0.8, max(y for _, y in pos.values()) + 0.8)
    ax.axis("off")
    ax.set_title(f"{algorithm.name}: {algorithm.description}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    output = None
    if "--output" in args:
        i = args.index("--output")
        output = args[i + 1]
        del args[i : i + 2]
    config = parse_config(args)
    try:
        algorithm = config.algorithm()
        text = describe(algorithm)
    except ValueError as e:
        print(f"marin_rl.graph: {e}", file=sys.stderr)
        return 2
    output = output or config.output_dir
    os.makedirs(output, exist_ok=True)
    stem = "+".join([algorithm.name, *algorithm.reward_models])  # e.g. rloo+rm: the graph with reward models
    dot = os.path.join(output, f"{stem}.dot")
    with open(dot, "w") as f:
        f.write(to_dot(algorithm))
    png = draw(algorithm, os.path.join(output, f"{stem}.png"))
    print(text)
    print(f"wrote {dot} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
