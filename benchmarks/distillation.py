"""On-policy distillation against reward-only RL on the addition task, from the same student start, same steps.

    python benchmarks/distillation.py [--config experiments/distill_addition.yaml] [--learning-rates 3e-4 1e-3]
                                      [--seeds 0 1 2] [--group-size 2] [--field.path VALUE ...]
    python benchmarks/distillation.py --replot benchmarks/distillation.json
    python benchmarks/distillation.py --smoke     # a tiny random teacher, two steps each (seconds; the test suite)

Runs the distillation experiment (which makes its teacher first when `teacher.path` holds none), then the same
experiment as reward-only RL (`learner.algorithm: rloo`, the clipped decoupled objective, no teacher), each into a
fresh output directory, back to back; the two share the warm start (same seed and steps). With several learning rates,
the pair runs at each. Writes `benchmarks/distillation.png` (held-out reward against learner step, one panel per
learning rate) and `benchmarks/distillation.json` (the curves), and prints them as Markdown tables. With several
`--seeds` (`orchestrator.seed`: the problems drawn, the samples, the warm start's batches) the pair runs once per
seed; the figure and tables show the mean over seeds, the JSON keeps every seed's curves too, and a line per learning
rate gives the paired difference (distillation minus reward-only RL, each seed's mean over its evaluations after step
0) as mean ± standard error over the seeds. `--group-size` sets every environment's group size. Extra `--field
value` arguments override every run's config (`--teacher.top_k 8 --learner.loss.objective opd_forward_kl_topk`: the
top-k forward-KL variant against the same reward-only twin). `--replot` draws the figure of recorded curves again. The
last line is `distill_over_rl=<held-out reward at the last evaluation, distillation ÷ reward-only RL>` (the first
learning rate's, mean over seeds).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile

from marin_rl.config import RunConfig, parse_config
from marin_rl.frozen import thaw
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


REWARD_ONLY = "reward-only RL (rloo)"


def distill_label(config: RunConfig) -> str:
    """The distillation curve's label: its objective (`opd_reverse_kl`, or `opd_forward_kl_topk` with the top-k)."""
    top_k = f", top_k {config.teacher.top_k}" if config.teacher is not None and config.teacher.top_k else ""
    return f"distillation ({config.learner.loss.objective}{top_k})"


SMOKE = [
    "--learner.warm_start.steps",
    "5",
    "--orchestrator.num_steps",
    "2",
    "--orchestrator.eval_every",
    "2",
    "--checkpoint.every",
    "0",
    "--orchestrator.num_cpus",
    "2",
]
"""Overrides of `--smoke`: two steps after a five-step warm start, held-out evaluation at the end only."""


def random_teacher(config: RunConfig, path: str) -> str:
    """`--smoke`'s teacher: a randomly initialised policy of the run's architecture (another seed), exported."""
    import dataclasses

    from marin_rl.model.build import build_model
    from marin_rl.model.hf import export_hf_checkpoint
    from marin_rl.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.tokenizer)
    model = build_model(dataclasses.replace(config.model, seed=config.model.seed + 1), len(tokenizer))
    return export_hf_checkpoint(model, tokenizer, path)


def run_pair(distill: RunConfig, env: str) -> dict[str, list[tuple[int, float]]]:
    """Run `distill` and its reward-only twin (same config, no teacher, rloo with the decoupled objective) into fresh
    directories `<output_dir>_opd` and `<output_dir>_rl`; their held-out reward curves."""
    base_dir = distill.output_dir
    distill = copy.deepcopy(distill)
    distill.output_dir = f"{base_dir}_opd"
    reward_only = copy.deepcopy(distill)
    reward_only.output_dir = f"{base_dir}_rl"
    reward_only.teacher = None
    reward_only.learner.algorithm = "rloo"
    reward_only.learner.loss.objective = "decoupled"
    curves = {}
    for label, config in ((distill_label(distill), distill), (REWARD_ONLY, reward_only)):
        shutil.rmtree(config.output_dir, ignore_errors=True)
        print(f"== {label}: {config.output_dir}", file=sys.stderr, flush=True)
        run(config)
        curves[label] = eval_curve(config.output_dir, env)
    return curves


def mean_curve(curves: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """The mean over runs of held-out reward at each step every run evaluated."""
    steps = sorted(set.intersection(*(set(dict(c)) for c in curves)))
    return [(s, sum(dict(c)[s] for c in curves) / len(curves)) for s in steps]


def paired_difference(per_seed: list[dict[str, list]], distill: str) -> tuple[float, float]:
    """Distillation minus reward-only RL, each seed's mean over its evaluations after step 0: (mean, standard error
    over the seeds; 0 with one seed)."""
    diffs = []
    for curves in per_seed:
        a, b = dict(curves[distill]), dict(curves[REWARD_ONLY])
        steps = [s for s in a if s > 0 and s in b]
        diffs.append(sum(a[s] - b[s] for s in steps) / len(steps))
    mean = sum(diffs) / len(diffs)
    if len(diffs) < 2:
        return mean, 0.0
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, (var / len(diffs)) ** 0.5


def plot(results: dict[str, dict[str, list]], env: str, path: str, per_seed: dict[str, list] | None = None) -> None:
    """One panel per learning rate, held-out reward against learner step for each method (the mean over seeds; with
    `per_seed`, each seed's curve drawn thin in the same colour)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(max(7, 5 * len(results)), 4.5), sharey=True, squeeze=False)
    for ax, (lr, curves) in zip(axes[0], results.items(), strict=True):
        seeds = (per_seed or {}).get(lr, [])
        seeds = seeds if len(seeds) > 1 else []  # one seed's curve is the mean itself
        for label, curve in curves.items():
            (line,) = ax.plot([s for s, _ in curve], [r for _, r in curve], marker="o", label=label)
            for seed_curve in (c[label] for c in seeds):
                ax.plot(
                    [s for s, _ in seed_curve], [r for _, r in seed_curve], color=line.get_color(), lw=0.7, alpha=0.35
                )
        ax.set_title(f"learning rate {lr}")
        ax.set_xlabel("learner step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"held-out reward ({env})")
    axes[0][0].legend()
    fig.suptitle("On-policy distillation vs reward-only RL, students from the same warm start", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(curves: dict[str, list]) -> str:
    """The curves as a Markdown table, one row per evaluated step."""
    labels = list(curves)
    lines = ["| step | " + " | ".join(labels) + " |", "|---:|" + "---:|" * len(labels)]
    for s in sorted({s for c in curves.values() for s, _ in c}):
        lines.append(f"| {s} | " + " | ".join(f"{dict(curves[k]).get(s, float('nan')):.3f}" for k in labels) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="experiments/distill_addition.yaml")
    parser.add_argument("--output", default=os.path.join(HERE, "distillation.png"))
    parser.add_argument("--learning-rates", nargs="*", type=float, default=None)
    parser.add_argument("--seeds", nargs="*", type=int, default=None, help="orchestrator.seed of each repeat")
    parser.add_argument("--group-size", type=int, default=None, help="every environment's group_size")
    parser.add_argument("--replot", default=None, help="a recorded curves JSON to draw again (runs nothing)")
    parser.add_argument("--smoke", action="store_true", help="a tiny random teacher, two steps each (seconds)")
    args, overrides = parser.parse_known_args()
    if args.replot:
        with open(args.replot) as f:
            recorded = json.load(f)
        plot(recorded["curves"], recorded["env"], args.output, recorded.get("curves_per_seed"))
        print(f"wrote {args.output}")
        return
    scratch = tempfile.mkdtemp(prefix="distillation-bench-") if args.smoke else None
    if args.smoke:
        args.output = os.path.join(scratch, "distillation.png")
        overrides = [*SMOKE, "--output_dir", os.path.join(scratch, "run"), *overrides]
    config = thaw(parse_config(["--config", args.config, *overrides]))  # the smoke run and --group_size change it
    if args.smoke:
        config.envs[0].args["num_eval"] = 8
        config.envs[0].eval_samples_per_problem = 1
        config.teacher.path = random_teacher(config, os.path.join(scratch, "teacher"))
        config.teacher.recipe = None
        config.orchestrator.backend = "local"  # both runs in this process, the teacher an engine beside the student's
    if args.group_size is not None:
        for e in config.envs:
            e.group_size = args.group_size
    env = config.envs[0].name
    rates = args.learning_rates or [config.learner.optimizer.learning_rate]
    seeds = args.seeds or [config.orchestrator.seed]
    results, per_seed = {}, {}
    for lr in rates:
        per_seed[f"{lr:g}"] = []
        for seed in seeds:
            pair = copy.deepcopy(config)
            pair.learner.optimizer.learning_rate = lr
            pair.orchestrator.seed = seed
            if len(rates) > 1:
                pair.output_dir = f"{pair.output_dir}_lr{lr:g}"
            if len(seeds) > 1:
                pair.output_dir = f"{pair.output_dir}_s{seed}"
            per_seed[f"{lr:g}"].append(run_pair(pair, env))
        runs = per_seed[f"{lr:g}"]
        results[f"{lr:g}"] = {label: mean_curve([r[label] for r in runs]) for label in runs[0]}
    plot(results, env, args.output, per_seed)
    with open(os.path.splitext(args.output)[0] + ".json", "w") as f:
        json.dump({"env": env, "seeds": seeds, "curves": results, "curves_per_seed": per_seed}, f, indent=1)
    label = distill_label(config)
    for lr, curves in results.items():
        mean, se = paired_difference(per_seed[lr], label)
        print(f"\nlearning rate {lr}, mean of {len(seeds)} seed(s)\n{table(curves)}")
        print(f"distillation minus reward-only RL, mean over evaluations after step 0: {mean:+.3f} ± {se:.3f} (SE)")
    print(f"wrote {args.output}")
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    first = next(iter(results.values()))
    distilled, reward_only = first[label][-1][1], first[REWARD_ONLY][-1][1]
    print(f"distill_over_rl={distilled / max(reward_only, 1e-3):.3f}")


if __name__ == "__main__":
    main()
