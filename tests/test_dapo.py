"""DAPO (Yu et al. 2025): dynamic sampling in the replay buffer and batcher, and the soft overlong penalty."""

import asyncio
import json
import threading

import numpy as np
import pytest
from test_validation_paths import ENV, GROUP_SIZE, VOCAB, ScriptedWorkflow

from marin_rl.config import parse_config
from marin_rl.envs.base import SamplingParams
from marin_rl.envs.rewards import OverlongPenalty, add_overlong_penalty, soft_overlong_penalty
from marin_rl.replay.batcher import Batcher, BatcherConfig, FormedBatch
from marin_rl.replay.buffer import ReplayBuffer, ReplayConfig
from marin_rl.rollouts.controller import RolloutController
from marin_rl.rollouts.local_pool import LocalWorkerPool
from marin_rl.rollouts.worker import RolloutWorker
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


@pytest.mark.parametrize("estimator", ["rloo", "grpo", "dr_grpo", "turn_rloo"])
@pytest.mark.parametrize("reward", [0.1, 0.7, -3.3, 1e-9])
def test_a_zero_variance_group_is_dropped_whatever_its_reward(estimator, reward):
    """Every reward equal means every advantage is 0 exactly, whatever the value: 0.1 + 0.1 + 0.1 != 0.3 in floating
    point, so a baseline computed by sums would leave advantages of ~1e-17 and dynamic sampling would keep the group."""
    rng = np.random.default_rng(0)
    buffer, _ = _setup(estimator, dynamic=True)
    for n in (3, 4, 7):
        admitted = buffer.admit(_group([reward] * n, rng), max_version=0)
        assert not admitted.accepted and admitted.reason == "zero_advantage", (n, admitted)
    nearly = buffer.admit(_group([reward, reward, reward * (1 + 1e-6) + 1e-12], rng), max_version=0)
    assert nearly.accepted  # a real difference, however small, is signal


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


# ---- soft overlong penalty ------------------------------------------------------------------------------------


def test_soft_overlong_penalty_at_the_boundaries():
    """R = 0 up to L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache up to L_max, -1 beyond (L_max 20, L_cache 4)."""
    values = {n: soft_overlong_penalty(n, 20, 4) for n in (0, 15, 16, 17, 18, 19, 20, 21, 100)}
    assert values == {0: 0.0, 15: 0.0, 16: 0.0, 17: -0.25, 18: -0.5, 19: -0.75, 20: -1.0, 21: -1.0, 100: -1.0}
    assert [soft_overlong_penalty(n, 20, 0) for n in (19, 20, 21)] == [0.0, 0.0, -1.0]  # no buffer: a hard cut
    assert [soft_overlong_penalty(n, 4, 4) for n in (0, 1, 2, 4, 5)] == [0.0, -0.25, -0.5, -1.0, -1.0]


@pytest.mark.parametrize(("max_tokens", "cache"), [(4, 5), (0, 0), (8, -1)])
def test_overlong_penalty_settings_are_refused_in_one_line(max_tokens, cache):
    with pytest.raises(ValueError, match="overlong_penalty") as e:
        OverlongPenalty(max_response_tokens=max_tokens, cache_tokens=cache)
    assert "\n" not in str(e.value)


def test_a_run_config_refuses_a_cache_longer_than_the_limit(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("envs:\n  - name: addition\n    overlong_penalty: {max_response_tokens: 8, cache_tokens: 12}\n")
    with pytest.raises(SystemExit) as e:
        parse_config(["--config", str(cfg)])
    message = "envs[addition].overlong_penalty.cache_tokens (12) must not exceed max_response_tokens (8)"
    assert message in str(e.value) and "\n" not in str(e.value)


def _multi_turn(sampled: tuple[int, ...], reward: float, rng) -> Rollout:
    """A rollout of a prompt, then sampled turns of the given lengths with a 2-token tool reply between them; the
    reward is on the last sampled turn."""
    meta = InferenceMetadata(server="s", version_start=0, version_end=0)
    turns = [Turn("user", "q", rng.integers(4, 100, 3).tolist())]
    for i, n in enumerate(sampled):
        if i:
            turns.append(Turn("tool", "t", rng.integers(4, 100, 2).tolist()))
        last = i == len(sampled) - 1
        turns.append(
            Turn(
                "assistant",
                "a",
                rng.integers(4, 100, n).tolist(),
                sampler_logprobs=(-rng.random(n)).tolist(),
                reward=reward if last else 0.0,
                rewards={"correct": reward} if last else {},
                inference_metadata=meta,
            )
        )
    return Rollout(environment="e", problem_id="p", turns=turns)


def test_the_penalty_counts_every_sampled_turn_and_is_a_named_reward_in_the_metrics():
    rng = np.random.default_rng(3)
    penalty = OverlongPenalty(max_response_tokens=12, cache_tokens=4)
    # sampled tokens 5+3 = 8 (free), 6+4 = 10 (-0.5), 9+6 = 15 (over: -1)
    group = RolloutGroup("e", "p", [_multi_turn(s, 1.0, rng) for s in ((5, 3), (6, 4), (9, 6))])
    add_overlong_penalty(group, penalty)
    assert [r.reward for r in group.rollouts] == [1.0, 0.5, 0.0]
    for r, value in zip(group.rollouts, (0.0, -0.5, -1.0), strict=True):
        assert r.turns[-1].rewards == {"correct": 1.0, "overlong": value}
        assert all("overlong" not in t.rewards for t in r.turns[:-1])
    buffer = ReplayBuffer("e", ReplayConfig(advantage_estimator="rloo", dynamic_sampling=True))
    assert buffer.admit(group).accepted  # equal correctness, but the penalty makes the advantages differ
    metrics = buffer.metrics(0)
    assert metrics["replays/e/rewards/overlong/mean"] == pytest.approx(-0.5)
    assert metrics["replays/e/reward/mean"] == pytest.approx(0.5)
    off = RolloutGroup("e", "p", [_multi_turn(s, 1.0, rng) for s in ((5, 3), (6, 4))])
    add_overlong_penalty(off, OverlongPenalty())  # max_response_tokens unset: nothing changes
    assert [r.reward for r in off.rollouts] == [1.0, 1.0] and "overlong" not in off.rollouts[0].turns[-1].rewards


def test_worker_pool_applies_the_penalty_and_dynamic_sampling_drops_what_stays_uninformative():
    """The in-process worker pool and the rollout controller: every group is correct in all its rollouts; the groups
    whose rollouts differ in length are informative once penalised and trained, the others are dropped."""
    rng = np.random.default_rng(4)
    lengths = {"p0": ((5, 3), (6, 4)), "p1": ((4, 4), (4, 4)), "p2": ((9, 6), (2, 2)), "p3": ((3, 3), (2, 4))}
    groups = {pid: RolloutGroup(ENV, pid, [_multi_turn(s, 1.0, rng) for s in ls]) for pid, ls in lengths.items()}
    for g in groups.values():
        for r in g.rollouts:
            r.environment, r.problem_id = ENV, g.problem_id
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        pool = LocalWorkerPool(
            ScriptedWorkflow(groups),
            RolloutWorker(["127.0.0.1:1"], timeout_s=5.0),
            loop,
            group_size=GROUP_SIZE,
            sampling=SamplingParams(max_tokens=16),
            tokens_per_batch=32,
            deterministic=True,
            overlong=OverlongPenalty(max_response_tokens=12, cache_tokens=4),
        )
        config = ReplayConfig(min_group_size=GROUP_SIZE, max_age=8, dynamic_sampling=True)
        buffers = {ENV: ReplayBuffer(ENV, config, vocab_size=VOCAB)}
        batcher = Batcher(BatcherConfig(total_token_budget=32, max_seq_len=32, min_fill=0.5), buffers)
        controller = RolloutController({ENV: pool}, buffers, batcher, max_staleness=0, deterministic=True)
        trained: set[str] = set()
        for _ in range(200):
            controller.launch(served_version=0, batches_formed=0)
            pool.wait(0.05)
            controller.admit_finished(0)
            formed = controller.try_make_batch(0)
            if formed is not None:
                trained |= {item.rollout.problem_id for item, _ in formed.placed}
                assert all(item.rollout.turns[-1].rewards["overlong"] <= 0 for item, _ in formed.placed)
            if buffers[ENV].sampled_groups >= len(groups) and not len(buffers[ENV]):
                break
        metrics = controller.step_metrics(0)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
    # p0: 8 vs 10 sampled tokens (0 vs -0.5); p2: 15 vs 4 (-1 vs 0); p1 and p3 stay equal (8 and 6 tokens each)
    assert trained == {"p0", "p2"}
    assert metrics[f"replays/{ENV}/rejected/zero_advantage"] == 2
    assert metrics[f"replays/{ENV}/oversampling/groups"] == pytest.approx(4 / 2)


def test_a_run_config_refuses_dynamic_sampling_with_a_critic(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("replay: {dynamic_sampling: true}\nlearner: {algorithm: ppo}\n")
    with pytest.raises(SystemExit) as e:
        parse_config(["--config", str(cfg)])
    assert "replay.dynamic_sampling" in str(e.value) and "critic" in str(e.value) and "\n" not in str(e.value)
