"""Rule-based reward functions, and their weighted combination into a scalar reward.

A reward function scores one completion of one problem:

    def reward(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **fields) -> float

`fields` are the problem's `answer` and its `fields`; a function declares the ones it needs as keyword parameters
(`answer`, `choices`, ...) and may take `**kwargs` for the rest. Fields a function does not declare are not passed,
so `def exact(prompt, completion, prompt_ids, completion_ids, answer)` is a valid reward function.
Async functions (returning an awaitable) work with `aevaluate_rewards`.

Named rewards combine linearly: `reward = sum(weights[name] * value)`. A reward without a weight counts 0 (it is
still recorded on the turn, i.e. logged as a metric); a weight without a reward function is a configuration error.

Reward shaping over a whole rollout: DAPO's soft overlong penalty (Yu et al. 2025; `OverlongPenalty`, per
environment) is the named reward 'overlong' of the rollout's last sampled turn, added to that turn's reward with its
own weight after the episode, so it shows in the metrics like every named reward (`replays/{env}/rewards/overlong/...`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from marin_rl.bounds import bounded, check_fields, checks_deferred
from marin_rl.types import RolloutGroup

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


OVERLONG_REWARD = "overlong"
"""Name of the soft overlong penalty among a turn's named rewards."""


@dataclass
class OverlongPenalty:
    """DAPO's soft overlong punishment (Yu et al. 2025) of rollouts that run long, by their sampled tokens |y|."""

    max_response_tokens: int | None = bounded(None, ge=1)
    """L_max: beyond it a rollout's penalty is -1 (None: no penalty). |y| counts every token the policy sampled in the
    rollout, over all its turns."""
    cache_tokens: int = bounded(0, ge=0)
    """L_cache: the penalty falls linearly from 0 at |y| = L_max - L_cache to -1 at L_max (0: a hard cut at L_max)."""
    weight: float = bounded(1.0, ge=0)
    """The penalty's weight in the reward (DAPO adds it as it is: 1; 0 records it as a named reward only)."""

    def __post_init__(self):
        check_fields(self, "overlong_penalty")
        if not checks_deferred():
            self.check("overlong_penalty")

    def check(self, prefix: str) -> None:
        """Raise ValueError (naming the fields under `prefix`) when L_cache exceeds L_max."""
        if self.max_response_tokens is not None and self.cache_tokens > self.max_response_tokens:
            raise ValueError(
                f"{prefix}.cache_tokens ({self.cache_tokens}) must not exceed max_response_tokens "
                f"({self.max_response_tokens})"
            )

    @property
    def enabled(self) -> bool:
        """Whether rollouts are penalised (`max_response_tokens` is set)."""
        return self.max_response_tokens is not None


def soft_overlong_penalty(num_tokens: int, max_tokens: int, cache_tokens: int) -> float:
    """R(|y|) = 0 for |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache up to L_max; -1 beyond."""
    free = max_tokens - cache_tokens
    if num_tokens <= free:
        return 0.0
    if num_tokens <= max_tokens:
        return (free - num_tokens) / cache_tokens
    return -1.0


def add_overlong_penalty(group: RolloutGroup, penalty: OverlongPenalty) -> None:
    """Record each rollout's soft overlong penalty as the named reward 'overlong' of its last sampled turn and add it,
    times `penalty.weight`, to that turn's reward (in place; a rollout with no sampled turn is left alone)."""
    if not penalty.enabled:
        return
    for rollout in group.rollouts:
        sampled = [t for t in rollout.turns if t.is_sampled]
        if not sampled:
            continue
        value = soft_overlong_penalty(rollout.num_sampled_tokens, penalty.max_response_tokens, penalty.cache_tokens)
        last = sampled[-1]
        last.rewards = {**last.rewards, OVERLONG_REWARD: value}
        last.reward = float(last.reward + penalty.weight * value)
