"""Staleness sweep: synchronous against asynchronous RL on long completions, with the decoupled loss and plain PPO.

For each loss (`learner.loss.objective`: 'decoupled', 'ppo') and each `orchestrator.max_staleness` η (0: every
group is sampled by the policy being trained, so generation and training take turns; η > 0: generation runs up to η
versions ahead while the learner trains), the experiment (default `experiments/counting.yaml`: ~130 sampled tokens
per answer) runs end to end through `python -m marin_rl.run` with everything else equal. From each run's metrics:

- throughput: trained tokens per second of the loop (the driver's wall time from step 0 to the last step);
- held-out reward at each evaluation against the loop's wall time (reward per wall-second), and at the end;
- staleness: the mean version lag of the trained tokens.

It prints a table and writes a plot (`--plot`, default `benchmarks/staleness.png`): held-out reward against
wall-clock seconds, one panel per loss, one curve per η. The last line is `async_over_sync=<value>`: the best
throughput with η > 0 over the throughput with η = 0, for the first loss. `--smoke` runs η = 0 and 1 for two steps
each (a short warm start), so the suite checks the benchmark works.
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


def read_metrics(path: str) -> list[dict]:
    """The effective rows of a run's metrics.jsonl, one per step (a resumed run's rows replace earlier ones)."""
    from marin_rl.tracking import read_metrics as read

    return read(path)


def run(config: str, output_dir: str, loss: str, staleness: int, steps: int | None) -> dict:
    """One run of `config` with `loss` and max_staleness `staleness`; its figures (see the module docstring)."""
    overrides = [
        "--output_dir",
        output_dir,
        "--learner.loss.objective",
        loss,
        "--orchestrator.max_staleness",
        str(staleness),
        "--checkpoint.every",
        "0",
    ]
    with open(config) as f:
        max_age = yaml.safe_load(f).get("replay", {}).get("max_age", 1)
    overrides += ["--replay.max_age", str(max(max_age, staleness))]  # the hard bound must admit η
    if steps is not None:
        overrides += ["--orchestrator.num_steps", str(steps)]
    cmd = [sys.executable, "-m", "marin_rl.run", "--config", config, *overrides]
    print(f"run: loss={loss} max_staleness={staleness}", flush=True)
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            log.seek(0)
            sys.stderr.write(log.read()[-8000:])
            raise SystemExit(f"run loss={loss} max_staleness={staleness} failed (exit {proc.returncode})")
    rows = read_metrics(os.path.join(output_dir, "metrics.jsonl"))
    timed = sorted((r for r in rows if "time/elapsed_s" in r), key=lambda r: r.get("step", 0))
    start = timed[0]["time/elapsed_s"]
    loop_s = timed[-1]["time/elapsed_s"] - start
    trained = sum(r.get("learner/trained_tokens", 0.0) for r in rows if r.get("step", 0) >= 1)
    curve = [(r["time/elapsed_s"] - start, r["step"], r["eval/mean_reward"]) for r in timed if "eval/mean_reward" in r]
    lags = [r["batches/staleness/mean"] for r in rows if "batches/staleness/mean" in r]
    with open(os.path.join(output_dir, "summary.json")) as f:
        summary = json.load(f)
    return {
        "loss": loss,
        "max_staleness": staleness,
        "loop_s": loop_s,
        "steps": timed[-1].get("step", 0),
        "trained_tokens_per_s": trained / loop_s if loop_s > 0 else 0.0,
        "reward_start": summary["eval_reward_start"],
        "reward_end": summary["eval_reward_end"],
        "mean_lag": sum(lags) / len(lags) if lags else 0.0,
        "curve": curve,
    }


def plot(results: list[dict], path: str) -> None:
    """Held-out reward against loop seconds, a panel per loss, a curve per max_staleness."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = list(dict.fromkeys(r["loss"] for r in results))
    fig, axes = plt.subplots(1, len(losses), figsize=(5.5 * len(losses), 4), squeeze=False, sharey=True)
    for ax, loss in zip(axes[0], losses, strict=True):
        for r in (r for r in results if r["loss"] == loss):
            t, _, reward = zip(*r["curve"], strict=True) if r["curve"] else ((), (), ())
            ax.plot(t, reward, marker="o", label=f"η={r['max_staleness']} ({r['trained_tokens_per_s']:.0f} tok/s)")
        ax.set_title(f"loss: {loss}")
        ax.set_xlabel("loop wall-clock seconds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("held-out reward")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def smoke_config(path: str) -> str:
    """A tiny variant of `path` on the local backend: a short warm start, few held-out problems, a small batch."""
    with open(path) as f:
        raw = yaml.safe_load(f)
    raw["envs"][0]["args"]["num_eval"] = 4
    raw["envs"][0]["concurrency"] = 4
    raw["envs"][0]["eval_samples_per_problem"] = 1
    raw["envs"][0]["group_size"] = 4
    raw["envs"][0]["sampling"]["max_tokens"] = 40
    raw["learner"]["warm_start"]["steps"] = 5
    raw["batcher"]["total_token_budget"] = 4 * raw["batcher"]["max_seq_len"]
    raw["orchestrator"]["eval_every"] = 0
    # The smoke checks that this script runs and reads its runs; the backend does not matter to it, and the local one
    # (one process, no Ray) costs a third of the CPU. The full benchmark keeps the config's backend.
    raw["orchestrator"]["backend"] = "local"
    out = os.path.join(tempfile.mkdtemp(prefix="staleness-bench-"), "smoke.yaml")
    with open(out, "w") as f:
        yaml.safe_dump(raw, f)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "experiments", "counting.yaml"))
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4], help="max_staleness values")
    parser.add_argument("--losses", nargs="+", default=["decoupled", "ppo"], help="learner.loss.objective values")
    parser.add_argument("--steps", type=int, default=None, help="learner steps per run (default: the config's)")
    parser.add_argument("--output-dir", default=None, help="where the runs write (default: a temporary dir)")
    parser.add_argument("--plot", default=os.path.join(ROOT, "benchmarks", "staleness.png"))
    parser.add_argument("--smoke", action="store_true", help="η = 0 and 1, two steps each (for the test suite)")
    args = parser.parse_args()
    config, staleness, losses, steps = args.config, args.staleness, args.losses, args.steps
    if args.smoke:
        config, staleness, losses, steps = smoke_config(config), [0, 1], losses[:1], 2
    out = args.output_dir or tempfile.mkdtemp(prefix="staleness-bench-")
    results = [
        run(config, os.path.join(out, f"{loss}-eta{eta}"), loss, eta, steps) for loss in losses for eta in staleness
    ]
    print(f"\n{'loss':<10} {'η':>2} {'loop s':>7} {'tok/s':>7} {'lag':>5} {'reward start → end':>20}")
    for r in results:
        print(
            f"{r['loss']:<10} {r['max_staleness']:>2} {r['loop_s']:>7.1f} {r['trained_tokens_per_s']:>7.0f} "
            f"{r['mean_lag']:>5.2f} {r['reward_start']:>9.3f} → {r['reward_end']:.3f}"
        )
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    if not args.smoke:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    first = [r for r in results if r["loss"] == losses[0]]
    sync = next(r for r in first if r["max_staleness"] == 0)
    best_async = max((r for r in first if r["max_staleness"] > 0), key=lambda r: r["trained_tokens_per_s"])
    print(f"async_over_sync={best_async['trained_tokens_per_s'] / sync['trained_tokens_per_s']:.3f}")


if __name__ == "__main__":
    main()
