"""Environment shares of a batch over learner steps: a piecewise-linear curriculum, a pure function of the step.

An environment's share is either fixed (`envs[*].fraction`), scheduled (`curriculum.fractions`: (step, fraction)
points, linear in between, constant before the first point and after the last) or free: what the others leave of
1, split equally among the free ones. The batch trained at learner step s (its metrics row s) uses the shares at s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

Points = Sequence[tuple[int, float]]
"""A schedule of one environment: (learner step, fraction) points, steps strictly increasing."""


def check_points(where: str, points: Points) -> None:
    """Raise ValueError (one line naming `where`) unless `points` is a valid schedule: at least one point, each a
    (step, fraction) pair with an integer step >= 0 and a fraction in [0, 1], steps strictly increasing."""
    if not points:
        raise ValueError(f"{where}: needs at least one [step, fraction] point")
    previous = None
    for point in points:
        if len(point) != 2:
            raise ValueError(f"{where}: each point is [step, fraction], got {list(point)}")
        step, fraction = point
        if isinstance(step, bool) or not float(step).is_integer() or step < 0:
            raise ValueError(f"{where}: a step must be an integer >= 0, got {step}")
        if not math.isfinite(fraction) or not 0 <= fraction <= 1:
            raise ValueError(f"{where}: a fraction must be in [0, 1], got {fraction} at step {step}")
        if previous is not None and step <= previous:
            raise ValueError(f"{where}: steps must increase, got {step} after {previous}")
        previous = step


class FractionSchedule:
    """Each environment's share of a batch at a learner step (module docstring). `names`: every environment, in
    config order; `scheduled`: the points of those on a schedule; `fixed`: the fixed shares."""

    def __init__(self, names: Sequence[str], scheduled: Mapping[str, Points] = (), fixed: Mapping[str, float] = ()):
        self.names = list(names)
        self.scheduled = {n: [(int(s), float(f)) for s, f in p] for n, p in dict(scheduled).items()}
        self.fixed = {n: float(f) for n, f in dict(fixed).items()}
        unknown = sorted((set(self.scheduled) | set(self.fixed)) - set(self.names))
        if unknown:
            raise ValueError(f"curriculum.fractions names {unknown}, which are not environments (known: {self.names})")
        both = sorted(set(self.scheduled) & set(self.fixed))
        if both:
            raise ValueError(f"envs[{both[0]}] has both a fraction and a schedule in curriculum.fractions: set one")
        for name, points in self.scheduled.items():
            check_points(f"curriculum.fractions[{name}]", points)
        self.free = [n for n in self.names if n not in self.scheduled and n not in self.fixed]
        for step in self.breakpoints():
            given = {**self.fixed, **self._scheduled_at(step)}
            shares = {n: given[n] for n in self.names if n in given}
            total = sum(shares.values())
            if total > 1 + 1e-6:
                detail = ", ".join(f"{n} {f:g}" for n, f in shares.items())
                raise ValueError(f"curriculum.fractions: the shares sum to {total:g} > 1 at step {step} ({detail})")

    @classmethod
    def constant(cls, fractions: Mapping[str, float]) -> FractionSchedule:
        """Shares that do not change (every environment fixed)."""
        return cls(list(fractions), fixed=fractions)

    @property
    def varies(self) -> bool:
        """Whether some environment's share changes over the steps."""
        return any(len({f for _, f in p}) > 1 for p in self.scheduled.values())

    def breakpoints(self) -> list[int]:
        """Every step at which a scheduled share changes slope (the total is largest at one of them), or [0]."""
        return sorted({s for p in self.scheduled.values() for s, _ in p} | {0})

    def _scheduled_at(self, step: int) -> dict[str, float]:
        return {n: float(np.interp(step, [s for s, _ in p], [f for _, f in p])) for n, p in self.scheduled.items()}

    def at(self, step: int) -> dict[str, float]:
        """Each environment's share of the batch trained at learner step `step`: the fixed and scheduled ones in
        `names` order, then the free ones."""
        given = {**self.fixed, **self._scheduled_at(step)}
        shares = {n: given[n] for n in self.names if n in given}
        rest = max(0.0, 1.0 - sum(shares.values()))
        return {**shares, **{n: rest / len(self.free) for n in self.free}}
