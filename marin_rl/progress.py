"""Progress of long phases counted in steps (warm start, RL steps, supervised fine-tuning, reward-model training).

On a terminal (stderr is a TTY) a live `rich` bar shows the phase, step/total, rate, elapsed time and ETA, with log
lines printed above it. Elsewhere (a log file, CI, a Ray actor) there is no bar: one plain log line every
`interval_s` seconds (and every `every` steps, when given) and at the last step says the same, e.g.
`RL: step 120/300 (40%) | 1.85 steps/s | ETA 1m37s | addition reward 0.512`. Never both. The phases' own
per-step lines (`tracking.console_every`, `log_every`) are printed as before in both modes.
"""

from __future__ import annotations

import logging
import sys
import time

from marin_rl.logs import is_terminal

logger = logging.getLogger("marin_rl")

PLAIN_INTERVAL_S = 30.0
"""Default seconds between plain progress lines."""


def format_duration(seconds: float) -> str:
    """`1h02m`, `3m07s` or `12s`."""
    s = max(0, int(round(seconds)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class StepProgress:
    """Progress of one phase from step `start` to `total`; a context manager (`advance_to` inside it).

    `live`: draw a bar (default: whether stderr is a terminal). Plain mode logs to `log` (default: the `marin_rl`
    logger) every `interval_s` seconds, every `every` steps when given, and at the last step; the rate and ETA count
    only the steps taken since this progress started (a resumed run's earlier steps are not in its rate).
    """

    def __init__(
        self,
        label: str,
        total: int,
        *,
        start: int = 0,
        live: bool | None = None,
        interval_s: float = PLAIN_INTERVAL_S,
        every: int | None = None,
        log: logging.Logger | None = None,
        clock=time.monotonic,
    ):
        self.label, self.total, self.start_step = label, int(total), int(start)
        self.live = is_terminal(sys.stderr) if live is None else live
        self.interval_s, self.every = interval_s, every
        self.log = log or logger
        self.clock = clock
        self.step = self.start_step
        self._started = self._last_line = clock()
        self._bar = None
        self._task = None

    # ---- figures ----------------------------------------------------------------------------------------------
    def rate(self) -> float:
        """Steps per second since this progress started (0 before the first step)."""
        done = self.step - self.start_step
        elapsed = self.clock() - self._started
        return done / elapsed if done > 0 and elapsed > 0 else 0.0

    def eta_s(self) -> float | None:
        """Seconds left at the current rate (None before the first step)."""
        rate = self.rate()
        return (self.total - self.step) / rate if rate > 0 else None

    def line(self, note: str = "") -> str:
        """The plain progress line."""
        pct = 100.0 * self.step / self.total if self.total else 100.0
        eta = self.eta_s()
        parts = [
            f"{self.label}: step {self.step}/{self.total} ({pct:.0f}%)",
            f"{self.rate():.2f} steps/s",
            "ETA " + (format_duration(eta) if eta is not None else "?"),
        ]
        if note:
            parts.append(note)
        return " | ".join(parts)

    # ---- updates ----------------------------------------------------------------------------------------------
    def __enter__(self) -> StepProgress:
        self._started = self._last_line = self.clock()
        if self.live:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[note]}"),
                console=Console(file=sys.stderr),
                redirect_stdout=True,
                redirect_stderr=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total, completed=self.step, rate="", note="")
        return self

    def advance_to(self, step: int, note: str = "") -> None:
        """The phase reached `step` (may go back: a run rolled back to a checkpoint); `note`: a short status."""
        self.step = int(step)
        if self._bar is not None:
            rate = self.rate()
            self._bar.update(self._task, completed=self.step, rate=f"{rate:.2f} steps/s" if rate else "", note=note)
            return
        now = self.clock()
        due = now - self._last_line >= self.interval_s or self.step >= self.total
        if self.every and self.step % self.every == 0:
            due = True
        if due:
            self._last_line = now
            self.log.info(self.line(note))

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
