"""Frozen config trees: after a run's config is resolved (`RunConfig.resolve`), no field of it can change.

`freeze(config)` walks a dataclass tree (nested dataclasses, and those in lists, tuples and dict values) and makes
every node refuse `setattr`/`delattr` with `FrozenConfigError`, naming the field. The classes stay what they were
for `isinstance`, `dataclasses.fields`, `dataclasses.replace` (which builds a new, unfrozen node: derive a changed
config that way, then resolve it again), pickling (a frozen node travels, and arrives, frozen) and `copy.deepcopy`
(a frozen copy); `thaw(config)` is an unfrozen deep copy to change and resolve again. Assigning a field the value
it already holds is allowed. Lists and dicts inside a config (`envs`, `envs[*].args`) become `FrozenList` and
`FrozenDict`: still a `list` and a `dict` to read, compare, copy, pickle and encode, refusing every change in place.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

FROZEN_KEY = "_marin_rl_frozen"
"""The instance attribute that marks a frozen node."""


class FrozenConfigError(AttributeError):
    """A field of a resolved, frozen config was set."""


def is_frozen(obj: Any) -> bool:
    """Whether `obj` is a frozen config node."""
    return bool(getattr(obj, "__dict__", {}).get(FROZEN_KEY, False))


def _refuse_set(self, name: str, value: Any) -> None:
    if is_frozen(self):
        current = self.__dict__.get(name, dataclasses.MISSING)
        if current is value or (current is not dataclasses.MISSING and _same(current, value)):
            return
        raise FrozenConfigError(
            f"{_plain(type(self)).__name__}.{name}: this config is resolved and frozen; derive a changed one with "
            "dataclasses.replace(...) and resolve that"
        )
    object.__setattr__(self, name, value)


def _refuse_del(self, name: str) -> None:
    if is_frozen(self):
        raise FrozenConfigError(f"{_plain(type(self)).__name__}.{name}: this config is resolved and frozen")
    object.__delattr__(self, name)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a plain equality (arrays) are not the same
        return False


def _equal(self, other: Any) -> bool:
    """Dataclass equality that does not tell a frozen node from an unfrozen one of the same class."""
    if _plain(type(other)) is not _plain(type(self)):
        return NotImplemented
    return all(getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(self) if f.compare)


def _rebuild(cls: type, state: dict) -> Any:
    """Unpickle (or deep-copy) a node of `cls` with `state`, frozen again when it was."""
    obj = object.__new__(cls)
    obj.__dict__.update(state)
    if state.get(FROZEN_KEY):
        object.__setattr__(obj, "__class__", _frozen_class(cls))
    return obj


def _reduce(self, protocol: int):
    return _rebuild, (_plain(type(self)), dict(self.__dict__))


_FROZEN_CLASSES: dict[type, type] = {}


def _plain(cls: type) -> type:
    return cls.__bases__[0] if cls in _FROZEN_CLASSES.values() else cls


def _frozen_class(cls: type) -> type:
    """The subclass of dataclass `cls` whose frozen instances refuse changes (made once per class)."""
    if cls not in _FROZEN_CLASSES:
        _FROZEN_CLASSES[cls] = type(
            cls.__name__,
            (cls,),
            {
                "__setattr__": _refuse_set,
                "__delattr__": _refuse_del,
                "__reduce_ex__": _reduce,
                "__eq__": _equal,
                "__hash__": None,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "__doc__": cls.__doc__,
            },
        )
    return _FROZEN_CLASSES[cls]


class _FrozenContainer:
    """What `FrozenList` and `FrozenDict` share: the plain type they read as (`_plain`), every method of it that
    changes it in place refused (`_changes`), pickling and deep copies that stay frozen, and a no-argument
    construction that gives a plain, empty container (code that builds a new container of an object's own type and
    fills it, as draccus's encoder does, gets one it can fill)."""

    _plain: type
    _changes: tuple[str, ...]
    __hash__ = None  # type: ignore[assignment]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in cls._changes:
            setattr(cls, name, cls._refuse_change)

    def __new__(cls, *args, **kwargs):
        return cls._plain() if not args and not kwargs else super().__new__(cls)

    def _refuse_change(self, *args, **kwargs):
        raise FrozenConfigError(
            f"this {self._plain.__name__} is part of a config that is resolved and frozen; derive a changed config "
            "with dataclasses.replace(...) (or thaw(config)) and resolve that"
        )

    def __reduce_ex__(self, protocol: int):
        return type(self), (self._plain(self),)

    def __deepcopy__(self, memo: dict):
        return type(self)(copy.deepcopy(self._plain(self), memo))


class FrozenList(_FrozenContainer, list):
    """A list inside a frozen config: reads as a list (equal to one, a `list` for `isinstance`), refuses changes;
    `FrozenList()` is a plain, empty list."""

    _plain = list
    _changes = ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "pop", "remove")
    _changes += ("clear", "sort", "reverse")


class FrozenDict(_FrozenContainer, dict):
    """A dict inside a frozen config: reads as a dict (equal to one, a `dict` for `isinstance`), refuses changes;
    `FrozenDict()` is a plain, empty dict."""

    _plain = dict
    _changes = ("__setitem__", "__delitem__", "__ior__", "pop", "popitem", "clear", "update", "setdefault")


def freeze(obj: Any) -> Any:
    """Freeze the tree `obj`: every dataclass node in place; a list or dict is replaced by its frozen copy (a
    `FrozenList`/`FrozenDict` returned, and set on the dataclass that holds it). Returns the frozen tree."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if is_frozen(obj):
            return obj
        cls = _plain(type(obj))
        if cls.__setattr__ is not object.__setattr__ or getattr(cls, "__slots__", None):
            for f in dataclasses.fields(obj):
                freeze(getattr(obj, f.name))
            return obj  # a class with its own setattr (or slots) is left as it is
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            frozen = freeze(value)
            if frozen is not value:
                object.__setattr__(obj, f.name, frozen)
        object.__setattr__(obj, "__class__", _frozen_class(cls))
        object.__setattr__(obj, FROZEN_KEY, True)
        return obj
    if isinstance(obj, list) and not isinstance(obj, FrozenList):
        return FrozenList([freeze(item) for item in obj])
    if isinstance(obj, dict) and not isinstance(obj, FrozenDict):
        return FrozenDict([(key, freeze(item)) for key, item in obj.items()])
    if isinstance(obj, tuple):
        for item in obj:
            freeze(item)
    return obj


def thaw(obj: Any) -> Any:
    """An unfrozen deep copy of the tree `obj`, to change and resolve again (e.g. variants of a parsed config)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = object.__new__(_plain(type(obj)))
        new.__dict__.update({k: thaw(v) for k, v in obj.__dict__.items() if k != FROZEN_KEY})
        return new
    if isinstance(obj, list):
        return [thaw(item) for item in obj]  # a FrozenList thaws to a plain list
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(thaw(item) for item in obj)
    if isinstance(obj, dict):
        return {k: thaw(v) for k, v in obj.items()}  # a FrozenDict to a plain dict
    return copy.deepcopy(obj)
