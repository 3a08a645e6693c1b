"""DAPO (Yu et al. 2025): dynamic sampling in the replay buffer and batcher, and the soft overlong penalty."""

import json

import numpy as np
import pytest

from marin_rl.replay.batcher import Batcher, BatcherConfig, FormedBatch
from marin_rl.replay.buffer import ReplayBuffer, ReplayConfig
from marin_rl.types import InferenceMetadata, Rollout, RolloutGroup, Turn

PROMPT, GEN, GROUP = 3, 5, 4  # tokens per prompt and completion, rollouts per group


def _group(rewards, rng) -> RolloutGroup:
    meta = InferenceMetadata(server="s", version_start=0, version_end=0)
    rollouts = [
        Rollout(
            environment="e",
            problem_id="p",
            turns=[
                Turn("user", "q", rng.integers(4, 100, PROMPT).tolist()),
                Turn(
                    "assistant",
                    "a",
                    rng.integers(4, 100, GEN).tolist(),
                    sampler_logprobs=(-rng.random(GEN)).tolist(),
                    reward=float(r),
                    inference_metadata=meta,
                ),
            ],
        )
        for r in rewards
    ]
    return RolloutGroup(environment="e", problem_id="p", rollouts=rollouts)


# Each batch holds 12 rollouts (6 rows of 16 tokens, two 8-token rollouts a row) = 3 groups; with min_fill 0.9 it
# forms once 11 rollouts wait. Zero-variance groups (every reward equal) come between the informative ones.
ZERO = [[0, 0, 0, 0], [1, 1, 1, 1]]
MIXED = [[1, 0, 0, 1], [0, 1, 0, 0], [1, 1, 0, 1]]
ROUNDS = [
    ["z", "z", "m", "z", "z", "z", "m", "z", "z", "m"],  # 10 groups sampled, 3 trained
    ["z", "m", "z", "z", "z", "m", "z", "m"],  # 8 groups sampled, 3 trained
]


def _setup(estimator: str, dynamic: bool):
    buffer = ReplayBuffer("e", ReplayConfig(advantage_estimator=estimator, dynamic_sampling=dynamic, max_age=100))
    batcher = Batcher(BatcherConfig(total_token_budget=96, max_seq_len=16, min_fill=0.9), {"e": buffer})
    return buffer, batcher


def _feed(buffer, batcher, kinds, rng, zero_groups: set) -> FormedBatch | None:
    """Admit groups of `kinds` one by one, trying for a batch after each; returns the first batch formed."""
    for i, kind in enumerate(kinds):
        rewards = ZERO[i % 2] if kind == "z" else MIXED[i % 3]
        group = _group(rewards, rng)
        if kind == "z":
            zero_groups.add(group.group_id)
        buffer.admit(group, max_version=0)
        formed = batcher.try_make_batch(0)
        if isinstance(formed, FormedBatch):
            assert i == len(kinds) - 1, "the batch formed before its third informative group arrived"
            return formed
    return None


@pytest.mark.parametrize("estimator", ["rloo", "grpo", "dr_grpo", "turn_rloo"])
def test_dynamic_sampling_trains_no_zero_advantage_group_and_reports_the_oversampling(estimator):
    rng = np.random.default_rng(0)
    buffer, batcher = _setup(estimator, dynamic=True)
    zero_groups: set[str] = set()
    sampled_groups = trained_groups = 0
    for kinds in ROUNDS:
        formed = _feed(buffer, batcher, kinds, rng, zero_groups)
        assert formed is not None
        groups = {item.group_id for item, _ in formed.placed}
        assert not groups & zero_groups
        assert all(item.advantage != 0 for item, _ in formed.placed)
        assert len(formed.placed) == 12 and len(groups) == 3
        # counted by hand: every group of the round arrived since the previous batch; 3 of them are trained
        n = len(kinds)
        m = formed.metrics
        assert m["batches/e/sampled_groups"] == n and m["batches/e/trained_groups"] == 3
        assert m["batches/e/oversampling/groups"] == pytest.approx(n / 3)
        assert m["batches/e/sampled_tokens"] == n * GROUP * GEN
        assert m["batches/e/trained_tokens"] == 12 * GEN == int(formed.batch.loss_mask.sum())
        assert m["batches/e/oversampling/tokens"] == pytest.approx(n * GROUP * GEN / (12 * GEN))
        sampled_groups += n
        trained_groups += 3
    cumulative = buffer.metrics(0)
    assert cumulative["replays/e/sampled_groups"] == sampled_groups == 18
    assert cumulative["replays/e/trained_groups"] == trained_groups == 6
    assert cumulative["replays/e/oversampling/groups"] == pytest.approx(18 / 6)
    assert cumulative["replays/e/oversampling/tokens"] == pytest.approx(18 * GROUP * GEN / (24 * GEN))
    assert cumulative["replays/e/rejected/zero_advantage"] == len(zero_groups) == 12


def test_without_dynamic_sampling_zero_advantage_groups_are_trained():
    """The same stream without the option: the first batch forms earlier and holds zero-advantage groups."""
    rng = np.random.default_rng(0)
    buffer, batcher = _setup("rloo", dynamic=False)
    zero_groups: set[str] = set()
    formed = None
    for i, kind in enumerate(ROUNDS[0]):
        group = _group(ZERO[i % 2] if kind == "z" else MIXED[i % 3], rng)
        if kind == "z":
            zero_groups.add(group.group_id)
        buffer.admit(group, max_version=0)
        formed = batcher.try_make_batch(0)
        if isinstance(formed, FormedBatch):
            break
    assert isinstance(formed, FormedBatch)
    assert {item.group_id for item, _ in formed.placed} & zero_groups
    trained = len({item.group_id for item, _ in formed.placed})
    assert formed.metrics["batches/e/sampled_groups"] == i + 1 and formed.metrics["batches/e/trained_groups"] == trained


def test_sampling_counts_survive_a_checkpoint():
    """A buffer restored from its (JSON) state mid-round reports what an uninterrupted one does."""
    rng_a, rng_b = np.random.default_rng(1), np.random.default_rng(1)
    a, batcher_a = _setup("grpo", dynamic=True)
    b, batcher_b = _setup("grpo", dynamic=True)
    _feed(a, batcher_a, ROUNDS[0], rng_a, set())
    _feed(b, batcher_b, ROUNDS[0], rng_b, set())
    half = ROUNDS[1][:5]
    assert _feed(a, batcher_a, half, rng_a, set()) is None
    assert _feed(b, batcher_b, half, rng_b, set()) is None
    restored, batcher_r = _setup("grpo", dynamic=True)
    restored.load_state_dict(json.loads(json.dumps(b.state_dict())))
    end_a = _feed(a, batcher_a, ROUNDS[1][5:], rng_a, set())
    end_r = _feed(restored, batcher_r, ROUNDS[1][5:], rng_b, set())
    keys = [k for k in end_a.metrics if "/sampled_" in k or "/trained_" in k or "oversampling" in k]
    assert keys and {k: end_r.metrics[k] for k in keys} == {k: end_a.metrics[k] for k in keys}
    assert end_a.metrics["batches/e/sampled_groups"] == len(ROUNDS[1])
    cumulative = [k for k in a.metrics(0) if "sampled" in k or "trained" in k or "oversampling" in k]
    assert {k: restored.metrics(0)[k] for k in cumulative} == {k: a.metrics(0)[k] for k in cumulative}


def test_dynamic_sampling_is_refused_with_a_critic():
    with pytest.raises(ValueError, match="replay.dynamic_sampling") as e:
        ReplayConfig(dynamic_sampling=True, advantage_estimator="gae")
    assert "\n" not in str(e.value)
