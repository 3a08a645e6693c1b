"""Per-turn credit against a group baseline on a multi-turn task: held-out reward at equal learner steps.

`experiments/running_sum.yaml` (three policy turns, each rewarded 1 for the exact running total) is run from the same
warm start with each variant and seed:
- `rloo`: RLOO on the episode's total reward (every token of an episode gets the same advantage);
- `turn_rloo`: per-turn group advantages (`learner.algorithm: turn_rloo`, `replay.turn_lambda: 0`): each turn's
  reward against the other episodes' reward for the same turn, i.e. GAE over turns with λ = 0 and the group's
  leave-one-out mean return as the value (no critic);
- `turn_rloo_lam1`: the same with λ = 1 (each turn's return from it on against the others');
- `ppo`: PPO with a critic and GAE on per-turn rewards (`replay.gae_reward_credit: per_turn`).
All use the same steps, learning rate and batches' token budget; `orchestrator.seed` is the seed (problem order,
held-out split, sampling). Prints the held-out reward (mean total per episode, out of 3) at each evaluation,
averaged over seeds, writes the mean curves to a PNG, and ends with
`turn_over_group_reward=<final turn_rloo reward / final RLOO reward>` (seed means); with `ppo` also
`ppo_over_group_reward`.

    python benchmarks/credit_assignment.py [--steps 200] [--seeds 0 1 2] [--variants rloo turn_rloo ppo] \
        [--output-dir DIR] [--plot PNG]      # runs already finished under DIR are read, not run again
    python benchmarks/credit_assignment.py --smoke                                  # a few steps (the test suite)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments", "running_sum.yaml")
METRIC = "eval/running_sum/reward"
VARIANTS = {
    "rloo": ("group baseline (RLOO, episode reward)", []),
    "turn_rloo": (
        "per-turn group baseline (turn_rloo, λ=0)",
        ["--learner.algorithm", "turn_rloo", "--replay.turn_lambda", "0"],
    ),
    "turn_rloo_lam1": (
        "per-turn group baseline (turn_rloo, λ=1)",
        ["--learner.algorithm", "turn_rloo", "--replay.turn_lambda", "1"],
    ),
    "ppo": (
        "PPO + critic + GAE (per-turn reward)",
        ["--learner.algorithm", "ppo", "--replay.gae_reward_credit", "per_turn"],
    ),
}


def run(config: str, output_dir: str, extra: list[str]) -> None:
    """One run of `config` to `output_dir` through the program users run; raises on failure."""
    cmd = [
        sys.executable,
        "-m",
        "marin_rl.run",
        "--config",
        config,
        "--output_dir",
        output_dir,
        "--checkpoint.every",
        "0",
        *extra,
    ]
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


def finished(output_dir: str, steps: int) -> bool:
    """Whether a run in `output_dir` evaluated at step `steps` (so it need not run again)."""
    path = os.path.join(output_dir, "metrics.jsonl")
    return os.path.exists(path) and any(s == steps for s, _ in eval_curve(output_dir))


def mean_curve(curves: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """Mean reward at the steps every curve has."""
    common = set.intersection(*(set(dict(c)) for c in curves))
    return [(s, float(np.mean([dict(c)[s] for c in curves]))) for s in sorted(common)]


def plot(curves: dict[str, list[tuple[int, float]]], path: str, seeds: int) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for label, curve in curves.items():
        ax.plot([s for s, _ in curve], [r for _, r in curve], marker="o", label=label)
    ax.set_xlabel("learner step")
    ax.set_ylabel(f"held-out reward (of 3 turns), mean of {seeds} seed{'s' * (seeds > 1)}")
    ax.set_title("running_sum: per-turn credit vs a group baseline")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def smoke_config() -> str:
    """running_sum.yaml on the local backend with a short warm start, a small batch, few held-out problems, 2 steps."""
    with open(CONFIG) as f:
        raw = yaml.safe_load(f)
    raw["envs"][0]["args"].update(num_eval=4, num_train=200)
    raw["envs"][0].update(concurrency=4, eval_samples_per_problem=1)
    raw["learner"]["warm_start"]["steps"] = 5
    raw["batcher"]["total_token_budget"] = 4 * raw["batcher"]["max_seq_len"]
    raw["orchestrator"].update(num_steps=2, eval_every=2)
    # The smoke checks that this script runs and reads its runs; the backend does not matter to it, and the local one
    # (one process, no Ray) costs a third of the CPU. The full benchmark keeps the config's backend.
    raw["orchestrator"]["backend"] = "local"
    path = os.path.join(tempfile.mkdtemp(prefix="credit-bench-"), "smoke.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="learner steps (default: the config's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="orchestrator seeds, each run per variant")
    parser.add_argument(
        "--variants", nargs="+", choices=sorted(VARIANTS), help="default: rloo turn_rloo ppo (--smoke: rloo turn_rloo)"
    )
    parser.add_argument("--output-dir", default=None, help="where the runs write, DIR/VARIANT-sSEED (default: temp)")
    parser.add_argument("--plot", default=None, help="PNG of the mean curves (default: OUTPUT_DIR/credit.png)")
    parser.add_argument("--smoke", action="store_true", help="2 small steps each (for the test suite)")
    args = parser.parse_args()
    args.variants = args.variants or (["rloo", "turn_rloo"] if args.smoke else ["rloo", "turn_rloo", "ppo"])
    if "rloo" not in args.variants:
        parser.error("--variants must include rloo (the baseline)")
    out = args.output_dir or tempfile.mkdtemp(prefix="credit-bench-")
    os.makedirs(out, exist_ok=True)
    config = smoke_config() if args.smoke else CONFIG
    with open(config) as f:
        steps = args.steps or yaml.safe_load(f)["orchestrator"]["num_steps"]
    runs: dict[str, list[str]] = {v: [] for v in args.variants}
    for seed in args.seeds:  # seed by seed, so that an interrupted sweep has whole comparisons
        for variant in args.variants:
            run_dir = os.path.join(out, f"{variant}-s{seed}")
            runs[variant].append(run_dir)
            if finished(run_dir, steps):
                print(f"finished already: {variant} seed {seed} ({run_dir})", flush=True)
                continue
            print(f"running {VARIANTS[variant][0]}, seed {seed} -> {run_dir}", flush=True)
            flags = ["--orchestrator.num_steps", str(steps), "--orchestrator.seed", str(seed)]
            run(config, run_dir, [*flags, *VARIANTS[variant][1]])
    per_seed = {v: [eval_curve(d) for d in dirs] for v, dirs in runs.items()}
    for v, curves in per_seed.items():
        finals = ", ".join(f"{c[-1][1]:.3f}" for c in curves)
        print(f"{VARIANTS[v][0]}: final held-out reward per seed {finals}")
    means = {v: mean_curve(curves) for v, curves in per_seed.items()}
    print(f"{'step':>6} " + " ".join(f"{v:>16}" for v in means))
    for s in sorted({s for c in means.values() for s, _ in c}):
        values = [dict(c).get(s) for c in means.values()]
        print(f"{s:>6} " + " ".join(f"{'-' if x is None else f'{x:.3f}':>16}" for x in values))
    path = args.plot or os.path.join(out, "credit.png")
    print(f"plot: {plot({VARIANTS[v][0]: c for v, c in means.items()}, path, len(args.seeds))}")
    base = max(means["rloo"][-1][1], 1e-9)
    for v, name in (("ppo", "ppo_over_group_reward"), ("turn_rloo", "turn_over_group_reward")):
        if v in means:
            print(f"{name}={means[v][-1][1] / base:.3f}")


if __name__ == "__main__":
    main()
