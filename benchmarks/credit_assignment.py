"""Per-turn credit against a group baseline on a multi-turn task: held-out reward at equal learner steps.

`experiments/running_sum.yaml` (three policy turns, each rewarded 1 for the exact running total) is run twice from
the same warm start: with RLOO on the episode's total reward (every token of an episode gets the same advantage), and
with PPO (`learner.algorithm: ppo`, critic and GAE) on per-turn rewards (`replay.gae_reward_credit: per_turn`: each
turn's reward credited to that turn's tokens). Both runs use the same seed, steps, learning rate and batches' token
budget. Prints the held-out reward (mean total per episode, out of 3) at each evaluation of both, writes both curves
to a PNG, and ends with `ppo_over_group_reward=<final PPO reward / final RLOO reward>`.

    python benchmarks/credit_assignment.py [--steps 200] [--output-dir DIR] [--plot PNG]
    python benchmarks/credit_assignment.py --from-runs RLOO_DIR PPO_DIR --plot PNG   # finished runs only
    python benchmarks/credit_assignment.py --smoke                                  # a few steps (the test suite)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments", "running_sum.yaml")
METRIC = "eval/running_sum/reward"
VARIANTS = {
    "group baseline (RLOO, episode reward)": [],
    "PPO + GAE (per-turn reward)": ["--learner.algorithm", "ppo", "--replay.gae_reward_credit", "per_turn"],
}


def run(config: str, output_dir: str, extra: list[str]) -> None:
    """One run of `config` to `output_dir` through the program users run; raises on failure."""
    cmd = [sys.executable, "-m", "marin_rl.run", "--config", config, "--output_dir", output_dir,
           "--checkpoint.every", "0", *extra]  # fmt: skip
    with open(output_dir + ".log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)


def eval_curve(output_dir: str) -> list[tuple[int, float]]:
    """(step, held-out reward) of every evaluation of a finished run (the latest row of a step wins)."""
    rows = {}
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if METRIC in row:
                rows[row["step"]] = row[METRIC]
    return sorted(rows.items())


def plot(curves: dict[str, list[tuple[int, float]]], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for label, curve in curves.items():
        ax.plot([s for s, _ in curve], [r for _, r in curve], marker="o", label=label)
    ax.set_xlabel("learner step")
    ax.set_ylabel("held-out reward (of 3 turns)")
    ax.set_title("running_sum: per-turn credit vs a group baseline")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def smoke_config() -> str:
    """running_sum.yaml with a short warm start, a small batch, few held-out problems and 2 steps."""
    with open(CONFIG) as f:
        raw = yaml.safe_load(f)
    raw["envs"][0]["args"].update(num_eval=4, num_train=200)
    raw["envs"][0].update(concurrency=4, eval_samples_per_problem=1)
    raw["learner"]["warm_start"]["steps"] = 5
    raw["batcher"]["total_token_budget"] = 4 * raw["batcher"]["max_seq_len"]
    raw["orchestrator"].update(num_steps=2, eval_every=2)
    path = os.path.join(tempfile.mkdtemp(prefix="credit-bench-"), "smoke.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="learner steps (default: the config's)")
    parser.add_argument("--output-dir", default=None, help="where the two runs write (default: a temporary dir)")
    parser.add_argument("--from-runs", nargs=2, metavar=("RLOO_DIR", "PPO_DIR"), help="compare finished runs")
    parser.add_argument("--plot", default=None, help="PNG of both curves (default: OUTPUT_DIR/credit.png)")
    parser.add_argument("--smoke", action="store_true", help="2 small steps each (for the test suite)")
    args = parser.parse_args()
    if args.from_runs:
        dirs = dict(zip(VARIANTS, args.from_runs, strict=True))
    else:
        out = args.output_dir or tempfile.mkdtemp(prefix="credit-bench-")
        os.makedirs(out, exist_ok=True)
        config = smoke_config() if args.smoke else CONFIG
        extra = ["--orchestrator.num_steps", str(args.steps)] if args.steps else []
        dirs = {}
        for label, flags in VARIANTS.items():
            dirs[label] = os.path.join(out, "ppo" if flags else "rloo")
            print(f"running {label} -> {dirs[label]}", flush=True)
            run(config, dirs[label], [*extra, *flags])
    curves = {label: eval_curve(d) for label, d in dirs.items()}
    steps = sorted({s for c in curves.values() for s, _ in c})
    print(f"{'step':>6} " + " ".join(f"{label[:34]:>36}" for label in curves))
    for s in steps:
        values = [dict(c).get(s) for c in curves.values()]
        print(f"{s:>6} " + " ".join(f"{'-' if v is None else f'{v:.3f}':>36}" for v in values))
    path = args.plot or os.path.join(os.path.dirname(next(iter(dirs.values()))), "credit.png")
    print(f"plot: {plot(curves, path)}")
    rloo, ppo = (c[-1][1] for c in curves.values())
    print(f"ppo_over_group_reward={ppo / max(rloo, 1e-9):.3f}")


if __name__ == "__main__":
    main()
