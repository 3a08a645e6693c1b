"""Validation of finished groups: the one check every rollout path runs before a group can be trained on.

`check_group(group, env_name, vocab_size)` raises `GroupRejected` with a short reason code naming the first problem:
the group's environment, its shape (non-empty, one problem, unique rollout ids) and every rollout's schema
(`Rollout.validate`, whose reason codes are kept: 'token_out_of_vocab', 'logprob_count', 'missing_metadata', ...).
The orchestrator's replay buffers (`ReplayBuffer.admit`, counted under `replays/{env}/rejected/{reason}`), the API's
`InferenceEngine` (gated groups, counted under `rejected/{reason}`) and `make_batch` all call it, so a malformed
group is refused with the same reason code whichever path it takes.
"""

from __future__ import annotations

from marin_rl.types import RolloutFormatError, RolloutGroup


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
    for r in group.rollouts:
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
