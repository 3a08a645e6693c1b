"""The step-and-cadence skeleton that every training loop runs: the RL learner's optimizer steps, the warm start,
supervised fine-tuning (`marin_rl.programs.sft`) and the reward model (`marin_rl.programs.reward_model`).

    state = run_steps(state, batches, step_fn, total=N, every=[Every(10, evaluate), Every(1, track)])

A loop is a state, an iterable of batches (built lazily, so a loop that stops early builds no more), a step function
`step_fn(state, batch) -> (state, metrics)`, and what runs every so many steps; progress shows on a terminal bar or
as log lines (`marin_rl.progress.StepProgress`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from marin_rl.progress import StepProgress


@dataclasses.dataclass(frozen=True)
class Every:
    """A cadence: `fn(step, state, metrics)` after every `n`-th step (1-based) and, with `at_end`, after the last
    one; `fn` may add to `metrics` (what later cadences and `describe` see). `n <= 0`: only at the end."""

    n: int
    """Steps between calls."""
    fn: Callable[[int, Any, dict[str, Any]], None]
    """What runs."""
    at_end: bool = True
    """Also after the last step (`total`)."""

    def due(self, step: int, total: int | None) -> bool:
        """Whether it runs after step `step` of `total`."""
        return (self.n > 0 and step % self.n == 0) or (self.at_end and step == total)


@dataclasses.dataclass(frozen=True)
class Progress:
    """How `run_steps` shows progress: a `StepProgress` named `name` (plain mode: a line every `every` steps when
    given, to `log`), its description after each step from `describe(metrics)`."""

    name: str
    """What the bar or the lines say is running."""
    describe: Callable[[dict[str, Any]], str] | None = None
    """The text after each step (e.g. the loss)."""
    every: int | None = None
    """Plain mode: a line every this many steps (and every 30 s)."""
    log: logging.Logger | None = None
    """Plain mode: the logger of the lines."""


_END = object()


def run_steps(
    state: Any,
    batches: Iterable[Any],
    step_fn: Callable[[Any, Any], tuple[Any, dict[str, Any]]],
    *,
    total: int | None = None,
    every: Sequence[Every] = (),
    progress: Progress | None = None,
    stop: threading.Event | None = None,
    what: str = "training",
) -> tuple[Any, int]:
    """Run `step_fn` over `batches` from `state`: step i (1-based) is `state, metrics = step_fn(state, batch)`, then
    each cadence of `every` that is due, in order. Stops after `total` steps (no further batch is drawn) or when
    the batches end. With `stop` set before a step, raises KeyboardInterrupt naming `what` and the steps done.
    Returns (the final state, the number of steps taken)."""
    step = 0
    shown = StepProgress(progress.name, total, every=progress.every, log=progress.log) if progress else None
    with shown if shown is not None else contextlib.nullcontext():
        if total is not None and total <= 0:
            return state, 0
        it = iter(batches)
        while total is None or step < total:
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt(f"{what} interrupted after {step} of {total} steps")
            batch = next(it, _END)
            if batch is _END:
                break
            state, metrics = step_fn(state, batch)
            step += 1
            for cadence in every:
                if cadence.due(step, total):
                    cadence.fn(step, state, metrics)
            if shown is not None:
                shown.advance_to(step, progress.describe(metrics) if progress.describe else "")
    return state, step
