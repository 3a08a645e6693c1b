"""Which rollouts go into a batch: pure functions of rollout lengths, token targets and free row space.

Each environment's rollouts are given newest first, as an array of token counts; a choice is an index into it.
`env_targets` computes each environment's token target for a batch; `select_within_targets` takes rollouts
round-robin by largest remaining deficit without exceeding any target; `fill_gaps` places more rollouts into the
free space of rows that packing left. `Batcher` (`marin_rl.replay.batcher`) wires them to the buffers and the packer.
"""

from __future__ import annotations

import numpy as np


def _share_out(amount: float, weights: dict[str, float], caps: dict[str, float] | None) -> dict[str, float]:
    """Split `amount` by `weights`, never giving an env more than its cap (what is left over is not handed out)."""
    extra = dict.fromkeys(weights, 0.0)
    open_ = {n for n, w in weights.items() if w > 0 and (caps is None or caps[n] > 0)}
    while amount > 1e-9 and open_:
        total = sum(weights[n] for n in open_)
        given = 0.0
        for n in list(open_):
            portion = amount * weights[n] / total
            if caps is not None:
                portion = min(portion, caps[n] - extra[n])
                if caps[n] - extra[n] - portion <= 1e-9:
                    open_.discard(n)
            extra[n] += portion
            given += portion
        amount -= given
        if caps is None or given <= 1e-12:
            break
    return extra


def env_targets(
    fractions: dict[str, float],
    budget: int,
    available: dict[str, int],
    remainder: str = "proportional",
    fill_shortfall: bool = False,
) -> dict[str, float]:
    """Token target of each environment for one batch.

    Environment e gets `fraction_e × budget`. What the fractions leave over (they may sum to less than 1) is shared
    by `remainder`: 'proportional' to the tokens each environment has beyond its share, 'by_fraction' in proportion
    to the fractions, or 'none'. With `fill_shortfall` an environment holding less than its share is targeted at
    what it has, and the others fill the gap (proportionally to what they have beyond their share).
    """
    base = {n: f * budget for n, f in fractions.items()}
    shortfall = 0.0
    if fill_shortfall:
        for n in base:
            if available[n] < base[n]:
                shortfall += base[n] - available[n]
                base[n] = float(available[n])
    rest = max(0.0, budget - sum(fractions.values()) * budget)
    surplus = {n: max(0.0, available[n] - base[n]) for n in base}
    extra = dict.fromkeys(base, 0.0)
    if remainder == "proportional":
        extra = _share_out(rest + shortfall, surplus, surplus)
    else:
        if remainder == "by_fraction" and rest > 0:
            weights = fractions if sum(fractions.values()) > 0 else dict.fromkeys(fractions, 1.0)
            extra = _share_out(rest, weights, None)
        if shortfall > 0:
            caps = {n: max(0.0, surplus[n] - extra[n]) for n in base}
            more = _share_out(shortfall, caps, caps)
            extra = {n: extra[n] + more[n] for n in base}
    return {n: base[n] + extra[n] for n in base}


def select_within_targets(lens: dict[str, np.ndarray], targets: dict[str, float]) -> list[tuple[str, int]]:
    """Round-robin over environments by largest remaining deficit: each in turn takes its newest rollout that still
    fits its deficit, so no environment exceeds its target. Returns the chosen (env, index) pairs in order."""
    got = dict.fromkeys(lens, 0)
    ptr = dict.fromkeys(lens, 0)
    selected: list[tuple[str, int]] = []
    open_envs = {n for n in lens if targets[n] >= 1 and len(lens[n])}
    while open_envs:
        env = max(open_envs, key=lambda n: targets[n] - got[n])
        deficit = targets[env] - got[env]
        fits = np.flatnonzero(lens[env][ptr[env] :] <= deficit)
        if not fits.size:
            open_envs.discard(env)
            continue
        i = ptr[env] + int(fits[0])
        ptr[env] = i + 1
        got[env] += int(lens[env][i])
        selected.append((env, i))
    return selected


def fill_gaps(
    lens: dict[str, np.ndarray],
    taken: dict[str, np.ndarray],
    targets: dict[str, float],
    free: list[int],
) -> list[tuple[str, int, int]]:
    """More rollouts for the free space `free[row]` of the rows, as (env, index, row) placements.

    Environment by largest remaining deficit, each places its newest untaken rollout that fits both a gap and its
    deficit, into the fullest row it fits (best fit); once none does, an environment still short of its target may
    place its newest rollout that fits a gap even if that exceeds the deficit (it then ends above its target by
    less than that rollout). `taken` (a mask per env) and `free` are updated in place.
    """
    got = {n: int(lens[n][taken[n]].sum()) for n in lens}
    placed: list[tuple[str, int, int]] = []
    for overshoot in (False, True):
        open_envs = {n for n in lens if targets[n] - got[n] >= (1e-9 if overshoot else 1)}
        while open_envs:
            env = max(open_envs, key=lambda n: targets[n] - got[n])
            limit = max(free) if overshoot else min(targets[env] - got[env], max(free))
            fits = np.flatnonzero((lens[env] <= limit) & ~taken[env])
            if not fits.size:
                open_envs.discard(env)
                continue
            i = int(fits[0])
            n_tok = int(lens[env][i])
            row = min((r for r in range(len(free)) if free[r] >= n_tok), key=lambda r: free[r])
            free[row] -= n_tok
            taken[env][i] = True
            got[env] += n_tok
            placed.append((env, i, row))
            if overshoot and got[env] >= targets[env]:
                open_envs.discard(env)
    return placed
