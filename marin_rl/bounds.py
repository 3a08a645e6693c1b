"""Declared ranges of numeric config fields, and the one walk over a config tree that enforces them.

A dataclass field declares its range where it is defined: `num_steps: int = bounded(100, ge=1)`. `field_errors`
walks a config (nested dataclasses and lists of them) and names every int or float field whose value is out of
its range, is NaN or infinite (refused for every float field, declared or not), or has the wrong type (a bool or a
float where an int is expected), as `dotted.field: reason`. A field with no declared range accepts any finite value
of its type: its docstring then says what 0 and negative values mean. A dataclass field may also declare `each=`,
a rule for every numeric field below it that declares no range itself (for another library's dataclasses:
`positive_unless_zero_default`).

A config class may check itself in `__post_init__` with `check_fields(self, "its.name")`, so that a config built
in code is refused at once too. Those checks are skipped inside `deferred_checks()`, where a parser builds the
whole tree first and then checks it once with `field_errors`, naming each field by its full path (a class used in
several places, or in a list, does not know its own path).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import Any

BOUNDS_KEY = "marin_rl.bounds"
"""Field-metadata key of a field's `Bounds`."""
EACH_KEY = "marin_rl.bounds.each"
"""Field-metadata key of the rule (`Bounds`, or a function of the field giving them) for the undeclared numeric
fields of the dataclasses below the field."""

_deferred: contextvars.ContextVar[bool] = contextvars.ContextVar("marin_rl_bounds_deferred", default=False)


@dataclass(frozen=True)
class Bounds:
    """An allowed range: every given limit must hold, unless the value is one of `also`."""

    ge: float | None = None
    """Lowest allowed value."""
    gt: float | None = None
    """Values must be above this."""
    le: float | None = None
    """Highest allowed value."""
    lt: float | None = None
    """Values must be below this."""
    also: tuple[float, ...] = ()
    """Special values allowed outside the range (e.g. -1 for 'all')."""

    def describe(self) -> str:
        """The range in words, e.g. '>= 1', 'in (0, 1]', '>= 1 or -1'."""
        low = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        high = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None
        if low and high:
            text = f"in {low}, {high}"
        elif low:
            text = f">= {self.ge}" if self.ge is not None else f"> {self.gt}"
        elif high:
            text = f"<= {self.le}" if self.le is not None else f"< {self.lt}"
        else:
            text = "any value"
        return text + "".join(f" or {a}" for a in self.also)

    def allows(self, value: float) -> bool:
        """Whether `value` is in the range (or one of `also`)."""
        if value in self.also:
            return True
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )


Rule = Bounds | Callable[[dataclasses.Field], Bounds]
"""A range for undeclared fields: the same for all, or one per field."""


def positive_unless_zero_default(f: dataclasses.Field) -> Bounds:
    """The rule for another library's model config: a number must be > 0, or >= 0 where the field's default is 0
    (a dropout rate, a count of optional parts)."""
    return Bounds(ge=0) if f.default == 0 else Bounds(gt=0)


def bounded(
    default: Any = MISSING,
    *,
    default_factory: Any = MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    also: tuple[float, ...] = (),
    each: Rule | None = None,
) -> Any:
    """A dataclass field with a declared range (`ge`, `gt`, `le`, `lt`, `also`: see `Bounds`); `each`: the range of
    every numeric field below this one (in the dataclass it holds, and theirs) that declares none."""
    metadata: dict[str, Any] = {}
    if (ge, gt, le, lt, also) != (None, None, None, None, ()):
        metadata[BOUNDS_KEY] = Bounds(ge=ge, gt=gt, le=le, lt=lt, also=tuple(also))
    if each is not None:
        metadata[EACH_KEY] = each
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def numeric_kind(annotation: Any) -> type | None:
    """`int` or `float` for a field annotated with one of them (or `X | None`), else None."""
    if annotation in (int, float):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(kinds) == 1 and kinds[0] in (int, float):
            return kinds[0]
    return None


def _type_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # a foreign class whose annotations do not resolve here: its fields' declared types
        return {f.name: f.type for f in dataclasses.fields(cls)}


def value_error(name: str, kind: type, value: Any, bounds: Bounds | None) -> str | None:
    """Why `value` cannot be the `kind` (int or float) field `name` under `bounds`, as 'name: reason'; None if it
    can (None values are the decoder's business: a field that is not optional never holds one)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and isinstance(value, float)):
        return f"{name}: expected {kind.__name__}, got {type(value).__name__} {value!r}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{name}: must be a finite number, got {value}"
    if bounds is not None and not bounds.allows(value):
        return f"{name}: must be {bounds.describe()}, got {value!r}"
    return None


def field_errors(config: Any, prefix: str = "", each: Rule | None = None) -> list[str]:
    """'dotted.field: reason' for every numeric field of `config` (a dataclass; nested dataclasses and lists of
    them included, list items as `name[i]`) whose value is of the wrong type, not finite, or out of its range.
    `each`: the range of numeric fields that declare none (from an enclosing field's `each=`, passed down)."""
    problems: list[str] = []
    hints = _type_hints(type(config))
    for f in dataclasses.fields(config):
        name = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(config, f.name, None)
        kind = numeric_kind(hints.get(f.name, f.type))
        if kind is not None:
            bounds = f.metadata.get(BOUNDS_KEY)
            if bounds is None and each is not None:
                bounds = each(f) if callable(each) else each
            problem = value_error(name, kind, value, bounds)
            if problem:
                problems.append(problem)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            problems += field_errors(value, name, f.metadata.get(EACH_KEY, each))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item) and not isinstance(item, type):
                    problems += field_errors(item, f"{name}[{i}]")
    return problems


def check_fields(config: Any, prefix: str) -> None:
    """Raise ValueError naming the first bad numeric field of `config` (see `field_errors`); nothing inside
    `deferred_checks()`."""
    if _deferred.get():
        return
    problems = field_errors(config, prefix)
    if problems:
        raise ValueError(problems[0])


def checks_deferred() -> bool:
    """Whether checks are deferred (inside `deferred_checks()`): a config class then leaves its cross-field checks to
    the caller too, which names the field by its full path."""
    return _deferred.get()


@contextlib.contextmanager
def deferred_checks():
    """Skip `check_fields` while a whole config tree is built (the caller then checks it with `field_errors`)."""
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)
