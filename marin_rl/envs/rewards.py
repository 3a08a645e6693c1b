"""Rule-based reward functions, and their weighted combination into a scalar reward.

A reward function scores one completion of one problem:

    def reward(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **fields) -> float

`fields` are the problem's `answer` and its `fields`; a function declares the ones it needs as keyword parameters
(`answer`, `choices`, ...) and may take `**kwargs` for the rest. Fields a function does not declare are not passed,
so `def exact(prompt, completion, prompt_ids, completion_ids, answer)` is a valid reward function.
Async functions (returning an awaitable) work with `aevaluate_rewards`.

Named rewards combine linearly: `reward = sum(weights[name] * value)`. A reward without a weight counts 0 (it is
still recorded on the turn, i.e. logged as a metric); a weight without a reward function is a configuration error.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

RewardFunction = Callable[..., Any]
"""`(prompt, completion, prompt_ids, completion_ids, **problem_fields) -> float` (or an awaitable of one)."""

REWARD_ARGS = ("prompt", "completion", "prompt_ids", "completion_ids")


class RewardFunctionError(RuntimeError):
    """A reward function raised, returned a non-number, or does not have the reward-function signature."""


def _accepted_fields(fn: RewardFunction, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The subset of `fields` that `fn` accepts as keyword arguments (all of them if it takes **kwargs)."""
    params = inspect.signature(fn).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {k: v for k, v in fields.items() if k not in REWARD_ARGS and (takes_kwargs or k in params)}


def _check_signature(name: str, fn: RewardFunction) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise RewardFunctionError(f"reward function {name!r} has no inspectable signature: {e}") from e
    positional = [
        p
        for p in sig.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    takes_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values())
    if len(positional) < len(REWARD_ARGS) and not takes_varargs:
        raise RewardFunctionError(
            f"reward function {name!r} must take (prompt, completion, prompt_ids, completion_ids, **problem_fields); "
            f"its signature is {sig}"
        )


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        return float(value)
    try:
        out = float(value)
    except (TypeError, ValueError) as e:
        raise RewardFunctionError(f"reward function {name!r} returned {value!r}, not a number") from e
    if not math.isfinite(out):
        raise RewardFunctionError(f"reward function {name!r} returned a non-finite reward {out}")
    return out


def check_reward_weights(weights: Mapping[str, float], names: list[str] | None = None, where: str = "") -> None:
    """Raise ValueError if a weight is not a finite number, or names a reward outside `names` (when given)."""
    prefix = f"{where}: " if where else ""
    for k, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w):
            raise ValueError(f"{prefix}reward_weights[{k!r}] must be a finite number, got {w!r}")
    if names is not None:
        unknown = sorted(set(weights) - set(names))
        if unknown:
            raise ValueError(f"{prefix}reward_weights name rewards {unknown} that are not computed; known: {names}")


def combine_rewards(rewards: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """`sum(weights[name] * value)` over the named rewards; a reward with no weight counts 0."""
    return float(sum(float(weights.get(k, 0.0)) * float(v) for k, v in rewards.items()))


def _calls(functions: Mapping[str, RewardFunction], fields: Mapping[str, Any]):
    for name, fn in functions.items():
        _check_signature(name, fn)
        yield name, fn, _accepted_fields(fn, fields)


def evaluate_rewards(
    functions: Mapping[str, RewardFunction],
    prompt: str,
    completion: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    problem_fields: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """Every reward function's value, by name.

    `problem_fields` (the problem's `answer` and `fields`) are passed as keyword arguments to the functions that
    accept them. A function that raises or returns a non-number raises `RewardFunctionError` naming it (reward
    functions must handle any model output themselves).
    """
    out = {}
    for name, fn, kwargs in _calls(functions, problem_fields or {}):
        try:
            value = fn(prompt, completion, prompt_ids, completion_ids, **kwargs)
        except Exception as e:
            raise RewardFunctionError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
        if inspect.isawaitable(value):
            if inspect.iscoroutine(value):
                value.close()  # never awaited: close it so no 'never awaited' warning is emitted
            raise RewardFunctionError(f"reward function {name!r} is async; use aevaluate_rewards")
        out[name] = _as_float(name, value)
    return out


async def aevaluate_rewards(
    functions: Mapping[str, RewardFunction],
    prompt: str,
    completion: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    problem_fields: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """`evaluate_rewards` for a mix of sync and async reward functions (awaited one after another)."""
    out = {}
    for name, fn, kwargs in _calls(functions, problem_fields or {}):
        try:
            value = fn(prompt, completion, prompt_ids, completion_ids, **kwargs)
            if inspect.isawaitable(value):
                value = await value
        except Exception as e:
            raise RewardFunctionError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
        out[name] = _as_float(name, value)
    return out


def exact_match(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], answer: str) -> float:
    """1.0 if the completion, stripped of surrounding whitespace, is exactly the reference answer."""
    return float(completion.strip() == str(answer).strip())
