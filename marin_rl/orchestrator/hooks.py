"""Cadenced work after a learner step (broadcast, evaluation, export, checkpoint), declared like Levanter's trainer
hooks: a function and how often it runs."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any


@dataclass
class StepHook:
    """Work that runs after learner steps: every `every` steps, after the last step (`at_end`), and when the run
    stops early on request (`when_stopping`)."""

    name: str
    """Name in logs and in the `time/hooks/{name}_s` metric."""
    every: int
    """Run after every this many steps (0: never periodically)."""
    run: Callable[[int], dict[str, float] | None]
    """Called with the step just completed; returns metrics to log with that step (or None)."""
    at_end: bool = True
    """Also run after the run's last step."""
    when_stopping: bool = False
    """Also run after the step at which a stop was requested (the run ends there)."""

    def due(self, step: int, last: bool, stopping: bool = False) -> bool:
        """Whether the hook runs after `step` (`last`: the run's final step; `stopping`: a stop was requested)."""
        return (
            (self.every > 0 and step % self.every == 0) or (self.at_end and last) or (self.when_stopping and stopping)
        )


class StepHooks:
    """Hooks run in the order given (broadcast before evaluation, evaluation before the checkpoint, ...)."""

    def __init__(self, hooks: list[StepHook]):
        names = [h.name for h in hooks]
        if len(set(names)) != len(names):
            raise ValueError(f"hook names must be unique, got {names}")
        self.hooks = list(hooks)

    def run(
        self, step: int, last: bool, stopping: bool = False, section: Callable[[str], Any] | None = None
    ) -> dict[str, float]:
        """Run the hooks due after `step`; returns their metrics merged, with each one's wall time. `section(name)`,
        when given, is a context manager each hook runs in (the loop profile's timer)."""
        out: dict[str, float] = {}
        for hook in self.hooks:
            if hook.due(step, last, stopping):
                start = time.perf_counter()
                with section(hook.name) if section is not None else nullcontext():
                    out.update(hook.run(step) or {})
                out[f"time/hooks/{hook.name}_s"] = time.perf_counter() - start
        return out
