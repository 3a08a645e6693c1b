"""Draw and list a run's algorithm: `python -m marin_rl.graph --config X [--output DIR] [dotted overrides]`.

Writes the algorithm's graph of model calls (`marin_rl.learner.algorithm`) as `DIR/<name>.dot` (Graphviz source) and
`DIR/<name>.png` (drawn with matplotlib, top to bottom and at most 1200 px wide: calls as boxes coloured by role,
solid on the learner side and dashed on the rollout side, data keys in italics, a legend below;
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
    "teacher": "#fdd0a2",
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


MAX_WIDTH_PX = 1200
"""The drawn picture is at most this wide (it fits the README's column at its natural size)."""

DPI = 100


def layout(algorithm: Algorithm) -> tuple[dict[str, tuple[float, float]], int]:
    """Node positions, top to bottom by dependency depth (inputs on the first row; a call one row below what it
    reads, a key one row below its writer), each row centred and ordered by its nodes' parents (fewer crossings);
    and the widest row's node count."""
    order = algorithm.ordered()
    depth: dict[str, int] = {f"key:{k}": 0 for k in INPUTS}
    parents: dict[str, list[str]] = {f"key:{k}": [] for k in INPUTS}
    for c in order:
        depth[c.name] = 1 + max((depth[f"key:{k}"] for k in c.reads), default=0)
        parents[c.name] = [f"key:{k}" for k in c.reads]
        for k in c.writes:
            depth[f"key:{k}"] = depth[c.name] + 1
            parents[f"key:{k}"] = [c.name]
    rows: dict[int, list[str]] = {}
    for node, d in depth.items():
        rows.setdefault(d, []).append(node)
    pos: dict[str, tuple[float, float]] = {}
    for d in sorted(rows):
        nodes = rows[d]
        if d > 0:  # barycentre of the parents already placed
            nodes.sort(key=lambda n: sum(pos[p][0] for p in parents[n]) / max(len(parents[n]), 1))
        for i, n in enumerate(nodes):
            pos[n] = (i - (len(nodes) - 1) / 2, -float(d))
    return pos, max(len(v) for v in rows.values())


def draw(algorithm: Algorithm, path: str) -> str:
    """Draw the graph (`figure`) as a PNG at `path`; returns `path`."""
    import matplotlib.pyplot as plt

    fig = figure(algorithm)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def figure(algorithm: Algorithm):
    """The graph as a matplotlib figure: top to bottom by dependency, at most `MAX_WIDTH_PX` wide at `DPI`, with a
    legend of the roles, the sides and the shapes; every edge is an arrow cut at the borders of the two boxes it
    joins, so its head shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    order = algorithm.ordered()
    pos, widest = layout(algorithm)
    levels = 1 + int(-min(y for _, y in pos.values()))
    width_in = min(MAX_WIDTH_PX / DPI, max(7.0, 2.3 * widest + 1.0))
    fig, ax = plt.subplots(figsize=(width_in, 0.8 * levels + 2.4), dpi=DPI)
    calls = {c.name: c for c in order}
    texts = {}
    for node, (x, y) in pos.items():
        if node in calls:
            c = calls[node]
            box = dict(
                boxstyle="round,pad=0.4", fc=ROLE_COLOURS[c.role], ec="#333333", ls="-" if c.side == "learner" else "--"
            )
            texts[node] = ax.text(
                x, y, f"{c.name}\n{c.role} · {c.kind}", ha="center", va="center", fontsize=10, bbox=box, zorder=3
            )
        else:
            texts[node] = ax.text(
                x,
                y,
                node[4:],
                ha="center",
                va="center",
                fontsize=10,
                style="italic",
                zorder=3,
                bbox=dict(boxstyle="round,pad=0.3,rounding_size=0.8", fc="white", ec="#888888"),
            )
    edges = [(f"key:{k}", c.name) for c in order for k in c.reads] + [
        (c.name, f"key:{k}") for c in order for k in c.writes
    ]
    for a, b in edges:
        span = pos[a][1] - pos[b][1]  # rows crossed
        # an edge over several rows bows outwards (left of the centre line to the left), around the rows between
        bow = 0.0 if span < 1.5 else (0.25 if pos[a][0] + pos[b][0] <= 0 else -0.25)
        ax.annotate(
            "",
            xy=pos[b],
            xytext=pos[a],
            zorder=4,  # drawn after the boxes, so the boxes' borders are known where the arrow is cut
            arrowprops=dict(
                arrowstyle="-|>",
                mutation_scale=14,
                color="#555555",
                lw=1.1,
                patchA=texts[a].get_bbox_patch(),
                patchB=texts[b].get_bbox_patch(),
                shrinkA=1,
                shrinkB=1,
                connectionstyle=f"arc3,rad={bow}",
            ),
        )
    xs = [x for x, _ in pos.values()]
    ax.set_xlim(min(xs) - 0.75, max(xs) + 0.75)
    ax.set_ylim(-(levels - 1) - 0.6, 0.6)
    ax.axis("off")
    roles = list(dict.fromkeys(c.role for c in order))
    handles = [Patch(fc=ROLE_COLOURS[r], ec="#333333", label=f"role {r}") for r in roles]
    handles += [
        Patch(fc="white", ec="#333333", ls="-", label="call on the learner side"),
        Patch(fc="white", ec="#333333", ls="--", label="call on the rollout side"),
        Patch(fc="white", ec="#888888", label="data key (italic)"),
        Line2D([], [], color="#555555", marker=">", markersize=6, label="reads / writes"),
    ]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=9, frameon=False)
    ax.set_title(f"{algorithm.name}: {algorithm.description}", fontsize=10, wrap=True)
    fig.tight_layout()
    return fig


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
