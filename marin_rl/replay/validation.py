"""Validation of finished groups: the one check every rollout path runs before a group can be trained on.

`check_group(group, env_name, vocab_size)` raises `GroupRejected` with a short reason code naming the first problem:
the group's environment, its shape (non-empty, one problem, unique rollout ids) and every rollout's schema
(`Rollout.validate`, whose reason codes are kept: 'token_out_of_vocab', 'logprob_count', 'missing_metadata', ...).
The orchestrator's replay buffers (`ReplayBuffer.admit`, counted under `replays/{env}/rejected/{reason}`), the API's
`InferenceEngine` (gated groups, counted under `rejected/{reason}`) and `make_batch` all call it, so a malformed
group is refused with the same reason code whichever path it takes. An ordinary group is checked in one pass over
its turns and one vectorised check per field for the whole group; only a group that may be wrong is checked rollout
by rollout, which names the first problem.
"""

from __future__ import annotations

import math

import numpy as np

from marin_rl.types import ROLES, RolloutFormatError, RolloutGroup


class GroupRejected(RolloutFormatError):
    """A group failed validation; `reason` is the short code counted in `replays/{env}/rejected/{reason}`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def check_group(group: RolloutGroup, env_name: str, vocab_size: int | None) -> None:
    """Raise `GroupRejected` naming the first problem of `group` for the environment `env_name`.

    Checks: known environment, non-empty group of one problem with unique rollout ids, and every rollout's
    schema (`Rollout.validate` with `vocab_size`; None: token ids need only be non-negative integers), whose reason
    codes are kept.
    """
    if group.environment != env_name:
        raise GroupRejected(
            "unknown_environment", f"group of env {group.environment!r} where env {env_name!r} was expected"
        )
    if not group.rollouts:
        raise GroupRejected("empty_group", f"group {group.group_id} has no rollouts")
    uids = [r.rollout_uid for r in group.rollouts]
    if len(set(uids)) != len(uids):
        raise GroupRejected("inconsistent_group", f"group {group.group_id} repeats a rollout_uid")
    if _plainly_valid(group, vocab_size):
        return
    for r in group.rollouts:  # something may be wrong: find the first problem, rollout by rollout
        if r.environment != group.environment or r.problem_id != group.problem_id:
            raise GroupRejected(
                "inconsistent_group",
                f"rollout {r.rollout_uid} is ({r.environment}, {r.problem_id}) in group "
                f"({group.environment}, {group.problem_id})",
            )
        try:
            r.validate(vocab_size)
        except RolloutFormatError as e:
            raise GroupRejected(e.reason, str(e)) from e


_ROLES = frozenset(ROLES)


def _plainly_valid(group: RolloutGroup, vocab_size: int | None) -> bool:
    """Whether every rollout of `group` certainly passes the per-rollout checks, found with one pass over the turns
    and one vectorised check per field over the whole group (token ids, logprobs, versions, rewards), instead of a
    few NumPy calls per turn. False when anything may be wrong, or is out of the ordinary (token ids other than
    Python ints, a teacher's fields): `check_group` then checks rollout by rollout and names the first problem, so
    what is accepted and every rejection's reason and message are the per-rollout checks' own."""
    ids: list = []
    logprobs: list = []
    versions: list = []
    lows: list = []
    highs: list = []
    rewards: list = []
    try:
        for r in group.rollouts:
            if r.environment != group.environment or r.problem_id != group.problem_id:
                return False
            turns = r.turns
            if not turns or turns[0].sampler_logprobs is not None or not turns[0].token_ids:
                return False
            sampled = False
            for t in turns:
                if t.role not in _ROLES:
                    return False
                if (
                    t.teacher_logprobs is not None
                    or t.teacher_top_ids is not None
                    or t.teacher_top_logprobs is not None
                    or t.routed_experts is not None
                ):
                    return False
                ids += t.token_ids
                rewards.append(t.reward)
                rewards += t.rewards.values()
                if t.sampler_logprobs is None:
                    continue
                sampled = True
                meta = t.inference_metadata
                n = len(t.token_ids)
                if len(t.sampler_logprobs) != n or meta is None or meta.version_start < 0:
                    return False
                logprobs += t.sampler_logprobs
                if meta.token_versions is not None:
                    if len(meta.token_versions) != n:
                        return False
                    versions += meta.token_versions
                    lows += [meta.version_start] * n
                    highs += [meta.version_end] * n
            if not sampled:
                return False
        if not set(map(type, ids)) <= {int} or not all(map(math.isfinite, rewards)):
            return False
        if ids:
            token_ids = np.asarray(ids)
            if token_ids.dtype.kind != "i" or token_ids.min() < 0:
                return False
            if vocab_size is not None and token_ids.max() >= vocab_size:
                return False
        if logprobs:
            lp = np.asarray(logprobs, dtype=np.float64)
            if lp.ndim != 1 or not (np.isfinite(lp).all() and lp.max() <= 1e-6):
                return False
        if versions:
            tv = np.asarray(versions, dtype=np.int64)
            if tv.ndim != 1 or (tv < np.asarray(lows)).any() or (tv > np.asarray(highs)).any():
                return False
    except Exception:  # noqa: BLE001 -- whatever it is, the per-rollout checks name it
        return False
    return True
