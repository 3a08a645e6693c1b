"""Cadenced work after a learner step (publish, broadcast, evaluation, export, checkpoint), declared like Levanter's
trainer hooks: a function and how often it runs, and whether it needs the learner (idle, at the step's version).

Hooks that do not need the learner may run while the next learner step trains (`StepHooks.split`): the driver
starts that step as soon as the hooks before them are done, which takes the servers' weight update and the
evaluation off the learner's critical path."""

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
    uses_learner: bool = True
    """Needs the learner idle at the completed step's version (publishing, exporting, checkpointing). A hook that
    does not may run while the next learner step trains."""

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

    def due(self, step: int, last: bool, stopping: bool = False) -> list[StepHook]:
        """The hooks due after `step`, in order."""
        return [h for h in self.hooks if h.due(step, last, stopping)]

    def split(self, step: int, last: bool, stopping: bool = False) -> tuple[list[StepHook], list[StepHook]]:
        """The due hooks as (before, during): `before` must run before the next learner step starts, `during` may
        run while it trains. `during` is the hooks after the leading ones that use the learner, and is empty
        (everything runs before) when a hook that uses the learner comes after one that does not: the order given
        always holds."""
        due = self.due(step, last, stopping)
        lead = 0
        while lead < len(due) and due[lead].uses_learner:
            lead += 1
        if any(h.uses_learner for h in due[lead:]):
            return due, []
        return due[:lead], due[lead:]

    def run(
        self,
        step: int,
        last: bool,
        stopping: bool = False,
        section: Callable[[str], Any] | None = None,
        hooks: list[StepHook] | None = None,
    ) -> dict[str, float]:
        """Run the hooks due after `step` (or the given `hooks`, e.g. one part of `split`); returns their metrics
        merged, with each one's wall time. `section(name)`, when given, is a context manager each hook runs in (the
        loop profile's timer)."""
        out: dict[str, float] = {}
        for hook in self.due(step, last, stopping) if hooks is None else hooks:
            start = time.perf_counter()
            with section(hook.name) if section is not None else nullcontext():
                out.update(hook.run(step) or {})
            out[f"time/hooks/{hook.name}_s"] = time.perf_counter() - start
        return out
