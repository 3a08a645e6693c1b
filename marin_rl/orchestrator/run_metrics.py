"""`RunMetrics`: a run's metric rows as the driver writes them: the tracker (metrics.jsonl, W&B), the clock and
generation-throughput columns, the console line and the progress display."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from typing import Any

import numpy as np
from levanter.tracker.tracker import Tracker

from marin_rl.config import RunConfig, without_secrets
from marin_rl.progress import StepProgress
from marin_rl.tracking import JsonlTracker, console_line, make_tracker

logger = logging.getLogger("marin_rl")


class RunMetrics:
    """The metric rows of the run of `config` (`open` starts its tracker, `finish` ends it)."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.env_names = [e.name for e in config.envs]
        self.started_at = time.time()
        """When this process started the run: `time/elapsed_s` counts from here."""
        self.tracker: Tracker | None = None
        self.jsonl: JsonlTracker | None = None
        """The metrics log (its history makes the reward plot; a rollback marks it like a resume)."""
        self.data_report: dict[str, float] = {}
        """What the environments loaded and skipped (`data/<env>/<key>`), from the check before the start: in the
        row of step 0 and the summary."""
        self.progress: StepProgress | None = None
        """The RL phase's progress display while the loop runs."""
        self._window_tokens = 0  # generated since the last step's row
        self._window_since = time.time()

    def open(self, resume_step: int | None, resume_path: str | None) -> None:
        """Start the tracker (appending to the metrics log from `resume_step` when resuming from `resume_path`) and
        log the config, secrets redacted, as its hyperparameters."""
        cfg = self.config
        run_name = cfg.tracking.run_name or os.path.basename(os.path.normpath(cfg.output_dir))
        self.tracker, self.jsonl = make_tracker(
            cfg.output_dir,
            cfg.tracking.wandb_mode,
            cfg.tracking.wandb_project,
            run_name,
            resume_step=resume_step,
            resume_path=resume_path,
        )
        self.tracker.log_hyperparameters(redacted(asdict(cfg)))

    def clock(self, now: float) -> dict[str, float]:
        """`time/elapsed_s`: seconds since this process started the run (a resumed run counts from its restart);
        `time/unix`: the Unix time of the row."""
        return {"time/elapsed_s": now - self.started_at, "time/unix": now}

    def count_generated(self, tokens: int) -> None:
        """Tokens the policy sampled, for the next row's throughput."""
        self._window_tokens += tokens

    def restart_window(self) -> None:
        """Throughput counts from now (the loop starts, or the run rolled back)."""
        self._window_tokens, self._window_since = 0, time.time()

    def step_columns(self) -> dict[str, float]:
        """`throughput/generated_tokens_per_s` since the last row, and the clock; the next window starts."""
        now = time.time()
        out = {"throughput/generated_tokens_per_s": self._window_tokens / max(now - self._window_since, 1e-9)}
        out.update(self.clock(now))
        self._window_tokens, self._window_since = 0, now
        return out

    def log_step(self, step: int, metrics: dict[str, float], last: bool) -> None:
        """Write a learner step's row, the console line every `tracking.console_every` steps (and the last), and
        advance the progress display with each environment's batch reward."""
        self.tracker.log(metrics, step=step)
        if step % self.config.tracking.console_every == 0 or last:
            logger.info(console_line(step, metrics, self.env_names))
        if self.progress is not None:
            rewards = ((n, metrics.get(f"batches/{n}/reward/mean")) for n in self.env_names)
            self.progress.advance_to(step, " | ".join(f"{n} reward {r:.3f}" for n, r in rewards if r is not None))

    def log_start(self, eval_start: dict[str, float], broadcast: dict[str, float]) -> None:
        """Write the row of step 0: the held-out evaluation before training, the first weight broadcast's timings,
        what the environments loaded (`data_report`), the learner's version 0 and the clock."""
        logger.info(
            "eval at start: %s", ", ".join(f"{k}={v:.3f}" for k, v in eval_start.items() if isinstance(v, float))
        )
        row = {**eval_start, **broadcast, **self.data_report, "learner/version": 0, **self.clock(time.time())}
        self.tracker.log(row, step=0)

    def finish(self) -> None:
        """End the tracker (when it was started)."""
        if self.tracker is not None:
            self.tracker.finish()


def eval_row(per_env: dict[str, float], env_names: list[str], started: float) -> dict[str, float]:
    """An evaluation's metric row: the environments' `eval/<env>/...` metrics, `eval/mean_reward` (the mean of their
    `eval/<env>/reward`) and `eval/seconds` (since `started`, a `time.time()`)."""
    return {
        **per_env,
        "eval/mean_reward": float(np.mean([per_env[f"eval/{n}/reward"] for n in env_names])),
        "eval/seconds": time.time() - started,
    }


def redacted(hparams: dict[str, Any]) -> dict[str, Any]:
    """The config as logged: secrets replaced."""
    return without_secrets(hparams, "<redacted>")
