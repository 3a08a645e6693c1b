"""`check_group`'s one-pass check of a whole group against the per-rollout checks it stands in for: on random groups,
valid and broken in every way `Rollout.validate` knows (and a few it does not), both accept the same groups and
reject the others with the same reason and message."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from marin_rl.replay.validation import GroupRejected, _plainly_valid, check_group
from marin_rl.types import InferenceMetadata, Rollout, RolloutFormatError, RolloutGroup, Turn

VOCAB = 60


def _reference(group: RolloutGroup, env_name: str, vocab_size: int | None) -> None:
    """The per-rollout checks, as `check_group` ran them before its one-pass check."""
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


def _rollout(rng: np.random.Generator, i: int) -> Rollout:
    turns = [Turn("user", "q", rng.integers(0, VOCAB, int(rng.integers(1, 5))).tolist(), rewards={"x": 0.0})]
    for _ in range(int(rng.integers(1, 3))):
        n = int(rng.integers(1, 5))
        v = int(rng.integers(0, 3))
        tv = None if rng.random() < 0.5 else sorted(rng.integers(v, v + 2, n).tolist())
        meta = InferenceMetadata(server="s", version_start=v, version_end=v + 1, token_versions=tv)
        logprobs = (-rng.random(n) * 3).tolist()
        turns.append(Turn("assistant", "a", rng.integers(0, VOCAB, n).tolist(), logprobs, 1.0, {}, meta))
        turns.append(Turn("tool", "t", rng.integers(0, VOCAB, int(rng.integers(0, 3))).tolist()))
    return Rollout("env", "p", turns, rollout_uid=f"u{i}")


def _break(group: RolloutGroup, rng: np.random.Generator, kind: str) -> None:
    r = group.rollouts[int(rng.integers(len(group.rollouts)))]
    sampled = [t for t in r.turns if t.sampler_logprobs is not None] or [_rollout(rng, 0).turns[1]]
    t = sampled[int(rng.integers(len(sampled)))]
    other = r.turns[int(rng.integers(len(r.turns)))] if r.turns else t
    if kind == "problem":
        r.problem_id = "q"
    elif kind == "no_turns":
        r.turns = []
    elif kind == "sampled_first":
        r.turns = [t, *r.turns]
    elif kind == "empty_prompt":
        r.turns[0].token_ids = []
    elif kind == "no_sampled":
        r.turns = [x for x in r.turns if x.sampler_logprobs is None]
    elif kind == "role":
        other.role = "narrator"
    elif kind == "float_id":
        other.token_ids = [*other.token_ids, 3.0]
    elif kind == "bool_id":
        other.token_ids = [*other.token_ids, True]
    elif kind == "numpy_ids":
        other.token_ids = np.asarray(other.token_ids, np.int32)
    elif kind == "negative_id":
        other.token_ids = [*other.token_ids, -1]
    elif kind == "big_id":
        other.token_ids = [*other.token_ids, VOCAB]
    elif kind == "huge_id":
        other.token_ids = [*other.token_ids, 2**70]
    elif kind == "nan_reward":
        other.reward = float("nan")
    elif kind == "inf_named_reward":
        other.rewards = {"y": float("inf")}
    elif kind == "string_reward":
        other.reward = "1.0"
    elif kind == "logprob_count":
        t.sampler_logprobs = t.sampler_logprobs[:-1]
    elif kind == "positive_logprob":
        t.sampler_logprobs = [*t.sampler_logprobs[:-1], 0.5]
    elif kind == "nan_logprob":
        t.sampler_logprobs = [float("nan"), *t.sampler_logprobs[1:]]
    elif kind == "string_logprob":
        t.sampler_logprobs = ["-0.5", *t.sampler_logprobs[1:]]
    elif kind == "no_metadata":
        t.inference_metadata = None
    elif kind == "no_version":
        t.inference_metadata.version_start = -1
    elif kind == "version_count":
        t.inference_metadata.token_versions = [t.inference_metadata.version_start] * (len(t.token_ids) + 1)
    elif kind == "version_range":
        t.inference_metadata.token_versions = [t.inference_metadata.version_end + 1] * len(t.token_ids)
    elif kind == "teacher":
        t.teacher_logprobs = [-0.1] * len(t.token_ids)
    elif kind == "teacher_everywhere":
        for x in r.turns:
            if x.sampler_logprobs is not None:
                x.teacher_logprobs = [-0.1] * len(x.token_ids)
    else:
        raise AssertionError(kind)


KINDS = (
    "problem no_turns sampled_first empty_prompt no_sampled role float_id bool_id numpy_ids negative_id big_id "
    "huge_id nan_reward inf_named_reward string_reward logprob_count positive_logprob nan_logprob string_logprob "
    "no_metadata no_version version_count version_range teacher teacher_everywhere"
).split()


UNUSUAL_KINDS = ("numpy_ids", "string_logprob", "teacher_everywhere")
"""Out of the ordinary, not necessarily wrong (NumPy ids, logprobs as numeric strings, a teacher's logprobs): the
per-rollout checks decide, whatever they decide."""


def _outcome(check, group, vocab):
    try:
        check(copy.deepcopy(group), "env", vocab)
    except GroupRejected as e:
        return ("rejected", e.reason, e.detail)
    except Exception as e:  # noqa: BLE001 -- the reference's own errors must be the same too
        return ("error", type(e).__name__)
    return ("accepted",)


@pytest.mark.parametrize("kind", [None, *KINDS])
def test_the_one_pass_check_decides_as_the_per_rollout_checks(kind):
    rng = np.random.default_rng(1 + KINDS.index(kind) if kind else 0)
    outcomes = set()
    for trial in range(30):
        group = RolloutGroup("env", "p", [_rollout(rng, i) for i in range(int(rng.integers(1, 6)))])
        for _ in range(int(rng.integers(1, 3)) if kind else 0):
            _break(group, rng, kind)
        for vocab in (VOCAB, None):
            want = _outcome(_reference, group, vocab)
            assert _outcome(check_group, group, vocab) == want, (kind, trial, vocab)
            outcomes.add(want[0])
            if kind is None:  # an ordinary valid group takes the one-pass check alone
                assert _plainly_valid(group, vocab)
            elif want[0] != "accepted":  # and nothing it passes would be rejected
                assert not _plainly_valid(copy.deepcopy(group), vocab)
    if kind is None:
        assert outcomes == {"accepted"}
    elif kind not in UNUSUAL_KINDS:
        assert outcomes - {"accepted"}, kind  # the breakage was caught at least once
