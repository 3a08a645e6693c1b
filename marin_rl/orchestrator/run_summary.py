"""The end of a run: its summary (returned by `run`, written to `output_dir/summary.json`, logged to the tracker)
and the reports made from it (the loop profile, the reward plot, the headline line)."""

from __future__ import annotations

import logging
import time
from typing import Any

from marin_rl.config import RunConfig
from marin_rl.orchestrator.checkpoints import hf_path
from marin_rl.orchestrator.profile import format_profile
from marin_rl.orchestrator.run_metrics import RunMetrics
from marin_rl.orchestrator.run_state import RunState
from marin_rl.report import headline_line, headline_summary, plot_rewards, write_summary

logger = logging.getLogger("marin_rl")


def run_summary(
    config: RunConfig,
    state: RunState,
    parts,
    metrics: RunMetrics,
    *,
    learner_restarts: int,
    rolled_back_steps: int,
    resumed_from: str | None,
    profile: dict[str, Any],
) -> dict[str, Any]:
    """The summary of a finished run: the headline (held-out reward at the start and the end), the token totals,
    the rollout controller's counters, restarts and rollbacks, where the servers and the final policy are, the warm
    start, the wall time, the loop profile and what the environments loaded (`metrics.data_report`). `parts`: the
    run's components; `metrics`: its metric rows (when it started)."""
    env_names = [e.name for e in config.envs]
    return {
        "steps": state.step,
        **headline_summary(state.eval_start, state.last_eval, env_names),
        "generated_tokens": state.generated_tokens,
        "trained_tokens": state.trained_tokens,
        **parts.rollouts.totals(),
        "server_restarts": parts.servers.restarts,
        "learner_restarts": learner_restarts,
        "rolled_back_steps": rolled_back_steps,
        "server_addresses": list(parts.servers.addresses),
        "broadcast_transport": parts.broadcast_transport,
        "final_checkpoint": hf_path(config, state.step),
        "warm_start_steps": config.learner.warm_start.steps,
        "warm_start_final_loss": state.warm_start.get("final_loss"),
        "wall_time_s": time.time() - metrics.started_at,
        "output_dir": config.output_dir,
        "resumed_from": resumed_from,
        "profile": profile,
        **metrics.data_report,
    }


def report_summary(metrics: RunMetrics, summary: dict[str, Any]) -> None:
    """Log the loop profile, hand the summary to the tracker, write `summary.json` and the reward plot, and log the
    headline line."""
    output_dir = metrics.config.output_dir
    logger.info(format_profile(summary["profile"]))
    metrics.tracker.log_summary(summary)
    write_summary(output_dir, summary)
    plot_rewards(output_dir, metrics.jsonl.history, metrics.env_names)
    logger.info(headline_line(summary))
