"""On-policy distillation against reward-only RL on the addition task, from the same student start, same steps.

    python benchmarks/distillation.py [--config experiments/distill_addition.yaml] [--field.path VALUE ...]

Runs the distillation experiment (which makes its teacher first when `teacher.path` holds none), then the same
experiment as reward-only RL (`learner.algorithm: rloo`, the clipped decoupled objective, no teacher), each into a
fresh output directory, back to back; the two share the warm start (same seed and steps). Writes
`benchmarks/distillation.png` (held-out reward against learner step, both curves) and `benchmarks/distillation.json`
(the curves), and prints them as a Markdown table. Extra `--field value` arguments override both runs' configs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys

from marin_rl.config import parse_config
from marin_rl.run import run

HERE = os.path.dirname(os.path.abspath(__file__))


def eval_curve(output_dir: str, env: str) -> list[tuple[int, float]]:
    """(learner step, held-out reward) of every evaluation in a run's metrics."""
    curve = []
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if f"eval/{env}/reward" in row:
                curve.append((int(row.get("step", 0)), float(row[f"eval/{env}/reward"])))
    return sorted(dict(curve).items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="experiments/distill_addition.yaml")
    parser.add_argument("--output", default=os.path.join(HERE, "distillation.png"))
    args, overrides = parser.parse_known_args()
    distill = parse_config(["--config", args.config, *overrides])
    base_dir = distill.output_dir
    distill.output_dir = f"{base_dir}_opd"
    reward_only = copy.deepcopy(distill)
    reward_only.output_dir = f"{base_dir}_rl"
    reward_only.teacher = None
    reward_only.learner.algorithm = "rloo"
    reward_only.learner.loss.objective = "decoupled"
    env = distill.envs[0].name
    curves = {}
    for label, config in (("distillation (opd_reverse_kl)", distill), ("reward-only RL (rloo)", reward_only)):
        shutil.rmtree(config.output_dir, ignore_errors=True)
        print(f"== {label}: {config.output_dir}", file=sys.stderr, flush=True)
        run(config)
        curves[label] = eval_curve(config.output_dir, env)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, curve in curves.items():
        ax.plot([s for s, _ in curve], [r for _, r in curve], marker="o", label=label)
    ax.set_xlabel("learner step")
    ax.set_ylabel(f"held-out reward ({env})")
    ax.set_title("Student from the same warm start: distillation vs reward-only RL")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    with open(os.path.splitext(args.output)[0] + ".json", "w") as f:
        json.dump({k: [[s, r] for s, r in v] for k, v in curves.items()}, f, indent=1)
    labels = list(curves)
    print("| step | " + " | ".join(labels) + " |")
    print("|---:|" + "---:|" * len(labels))
    steps = sorted({s for c in curves.values() for s, _ in c})
    for s in steps:
        print(f"| {s} | " + " | ".join(f"{dict(curves[k]).get(s, float('nan')):.3f}" for k in labels) + " |")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
