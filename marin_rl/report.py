"""End-of-run artifacts: `summary.json` and `reward.png` (train and eval reward against step), and the run's headline.

The headline of an environment is its held-out verifier score when it trains on a reward model's reward and has a
verifier of its own (`eval/ENV/verifier_reward`: for a 0/1 verifier, the held-out accuracy), else its held-out reward
(`eval/ENV/reward`). A reward model's score is what the policy is trained to raise, so it says little about whether
the policy got better; the verifier does. The trained-on reward stays in the summary as `eval_trained_reward_*`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import fsspec


def headline_key(metrics: dict[str, Any], env: str) -> str:
    """The metric that is `env`'s headline in `metrics` (an evaluation's `eval/...` keys)."""
    verifier = f"eval/{env}/verifier_reward"
    return verifier if verifier in metrics else f"eval/{env}/reward"


def headline_summary(start: dict[str, Any], end: dict[str, Any], env_names: list[str]) -> dict[str, Any]:
    """The summary's evaluation entries from the first and the last evaluation: `eval_reward_start` / `_end` (the
    mean over environments of each one's headline) and per environment (`eval_reward_start/ENV`, ...), the greedy
    completion's (`eval_greedy_reward_*/ENV`, the verifier's where it is the headline), `headline` (each environment's
    headline metric) and, where an environment's headline is its verifier, the reward it trained on
    (`eval_trained_reward_*`, e.g. the reward model's score)."""
    out: dict[str, Any] = {"headline": {n: headline_key(end, n) for n in env_names}}
    trained = [n for n in env_names if headline_key(end, n) != f"eval/{n}/reward"]
    for when, m in (("start", start), ("end", end)):
        heads = [m[headline_key(m, n)] for n in env_names]
        out[f"eval_reward_{when}"] = float(sum(heads) / len(heads))
        for n, h in zip(env_names, heads, strict=True):
            greedy = "verifier_greedy_reward" if n in trained else "greedy_reward"
            out[f"eval_reward_{when}/{n}"] = h
            out[f"eval_greedy_reward_{when}/{n}"] = m[f"eval/{n}/{greedy}"]
        if trained:
            out[f"eval_trained_reward_{when}"] = float(sum(m[f"eval/{n}/reward"] for n in trained) / len(trained))
            for n in trained:
                out[f"eval_trained_reward_{when}/{n}"] = m[f"eval/{n}/reward"]
    return out


def headline_line(summary: dict[str, Any]) -> str:
    """The run's last console line: the headline's change over the run, the trained-on reward's when it differs,
    the wall time and where the artifacts are."""
    start, end = summary["eval_reward_start"], summary["eval_reward_end"]
    verifier = any(k.endswith("/verifier_reward") for k in summary["headline"].values())
    what = "held-out verifier reward" if verifier else "eval reward"
    line = f"done: {what} {start:.3f} -> {end:.3f} ({end - start:+.3f})"
    if "eval_trained_reward_end" in summary:
        t0, t1 = summary["eval_trained_reward_start"], summary["eval_trained_reward_end"]
        line += f"; reward trained on (reward model) {t0:.3f} -> {t1:.3f}"
    return line + f" in {summary['wall_time_s']:.0f}s; see {summary['output_dir']}"


def write_summary(output_dir: str, summary: dict[str, Any]) -> str:
    path = os.path.join(output_dir, "summary.json")
    with fsspec.open(path, "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True, default=str)
    return path


def plot_rewards(output_dir: str, history: list[dict[str, Any]], env_names: list[str]) -> str:
    """`reward_figure` saved as `output_dir/reward.png`; returns its path."""
    import matplotlib.pyplot as plt

    fig = reward_figure(history, env_names)
    path = os.path.join(output_dir, "reward.png")
    with fsspec.open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return path


def reward_figure(history: list[dict[str, Any]], env_names: list[str]):
    """Train reward (per batch) and held-out eval reward for each environment against learner step: the headline
    (the verifier's score, for an environment trained on a reward model) as the bold line, the trained-on reward
    dashed beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for n in env_names:
        train = [
            (h["step"], h[f"batches/{n}/reward/mean"]) for h in history if h.get(f"batches/{n}/reward/mean") is not None
        ]
        evals = [h for h in history if h.get(f"eval/{n}/reward") is not None]
        verifier = any(f"eval/{n}/verifier_reward" in h for h in evals)
        trained = ", reward model's score" if verifier else ""
        if train:
            xs, ys = zip(*train, strict=True)
            ax.plot(xs, ys, alpha=0.6, label=f"{n} train{trained} (batch mean)")
        if verifier:
            pts = [(h["step"], h[f"eval/{n}/verifier_reward"]) for h in evals if f"eval/{n}/verifier_reward" in h]
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", linewidth=2, label=f"{n} eval, verifier's score (held-out)")
        if evals:
            xs, ys = zip(*[(h["step"], h[f"eval/{n}/reward"]) for h in evals], strict=True)
            style = {"linestyle": "--", "linewidth": 1.2} if verifier else {"linewidth": 2}
            ax.plot(xs, ys, marker="o", label=f"{n} eval{trained} (held-out)", **style)
    ax.set_xlabel("learner step (policy version)")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("marin_rl: reward during training")
    fig.tight_layout()
    return fig
