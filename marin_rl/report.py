"""End-of-run artifacts: `summary.json` and `reward.png` (train and eval reward against step)."""

from __future__ import annotations

import json
import os
from typing import Any

import fsspec


def write_summary(output_dir: str, summary: dict[str, Any]) -> str:
    path = os.path.join(output_dir, "summary.json")
    with fsspec.open(path, "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True, default=str)
    return path


def plot_rewards(output_dir: str, history: list[dict[str, Any]], env_names: list[str]) -> str:
    """Train reward (per batch) and held-out eval reward for each environment against learner step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for n in env_names:
        train = [
            (h["step"], h[f"batches/{n}/reward/mean"]) for h in history if h.get(f"batches/{n}/reward/mean") is not None
        ]
        evals = [(h["step"], h[f"eval/{n}/reward"]) for h in history if h.get(f"eval/{n}/reward") is not None]
        if train:
            xs, ys = zip(*train, strict=True)
            ax.plot(xs, ys, alpha=0.6, label=f"{n} train (batch mean)")
        if evals:
            xs, ys = zip(*evals, strict=True)
            ax.plot(xs, ys, marker="o", linewidth=2, label=f"{n} eval (held-out)")
    ax.set_xlabel("learner step (policy version)")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("marin_rl: reward during training")
    fig.tight_layout()
    path = os.path.join(output_dir, "reward.png")
    with fsspec.open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return path
