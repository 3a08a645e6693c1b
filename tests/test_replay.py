"""Advantages, replay buffer and batcher: reference values and properties over random inputs."""

import logging
import math
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marin_rl.replay.advantages import GroupAdvantages, dr_grpo, ema_baseline, grpo, reinforce, rloo
from marin_rl.replay.batcher import Batcher, BatcherConfig, BatchTimeoutError, BatchWait, FormedBatch
from marin_rl.replay.buffer import ReplayBuffer, ReplayConfig
from marin_rl.replay.packing import Sequence, best_fit_decreasing, first_fit_decreasing, pack, pack_rows
from marin_rl.replay.selection import env_targets
from marin_rl.types import InferenceMetadata, Rollout, RolloutGroup, Turn


def make_rollout(env, prompt_len, gen_len, reward, version, rng, rewards=None):
    prompt = rng.integers(4, 100, prompt_len).tolist()
    gen = rng.integers(4, 100, gen_len).tolist()
    meta = InferenceMetadata(server="s", version_start=version, version_end=version)
    return Rollout(
        environment=env,
        problem_id="p",
        turns=[
            Turn("user", "q", prompt),
            Turn(
                "assistant",
                "a",
                gen,
                sampler_logprobs=(-rng.random(gen_len)).tolist(),
                reward=reward,
                rewards=dict(rewards or {}),
                inference_metadata=meta,
            ),
        ],
    )


def make_group(env, n, rng, version=0, lens=(3, 5)):
    rs = [make_rollout(env, lens[0], lens[1], float(rng.integers(0, 2)), version, rng) for _ in range(n)]
    return RolloutGroup(environment=env, problem_id="p", rollouts=rs)


# ---- advantage estimators against NumPy references written from the formulas ------------------------------


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-10, 10), min_size=1, max_size=16))
def test_estimators_match_reference_formulas(rs):
    r = np.array(rs)
    n = len(r)
    mean = sum(rs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in rs) / n)
    loo = [r[i] - (np.sum(r) - r[i]) / (n - 1) if n > 1 else 0.0 for i in range(n)]
    np.testing.assert_allclose(rloo(r), loo, atol=1e-9)
    np.testing.assert_allclose(grpo(r), [(x - mean) / (std + 1e-6) for x in rs], atol=1e-6)
    np.testing.assert_allclose(grpo(r, normalize_std=False), [x - mean for x in rs], atol=1e-9)
    np.testing.assert_allclose(dr_grpo(r), [x - mean for x in rs], atol=1e-9)


def test_rloo_reference():
    r = np.array([1.0, 0.0, 0.0, 1.0, 1.0])
    expected = [r[i] - np.mean(np.delete(r, i)) for i in range(len(r))]
    np.testing.assert_allclose(rloo(r), expected)
    np.testing.assert_allclose(rloo(np.array([3.0])), [0.0])


def test_reinforce_uses_a_running_baseline_that_excludes_the_current_group():
    groups = [np.array([1.0, 0.0, 1.0]), np.array([0.0, 0.0]), np.array([2.0, 1.0, 0.0, 1.0])]
    est = GroupAdvantages("reinforce", baseline_decay=0.5)
    b = 0.0
    for g in groups:
        expected = [x - b for x in g]  # A_i = r_i - b, b from earlier groups only
        np.testing.assert_allclose(est(g), expected)
        b = 0.5 * b + 0.5 * (sum(g) / len(g))
        assert est.baseline == pytest.approx(b)
    np.testing.assert_allclose(reinforce(np.array([1.0, 3.0]), 2.0), [-1.0, 1.0])
    assert ema_baseline(1.0, np.array([3.0]), 0.75) == pytest.approx(1.5)
    est = GroupAdvantages("grpo", grpo_normalize_std=False)
    np.testing.assert_allclose(est(np.array([1.0, 3.0])), [-1.0, 1.0])
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        GroupAdvantages("ppo")
    with pytest.raises(ValueError, match="advantage_estimator"):
        ReplayConfig(advantage_estimator="ppo")


def test_named_rewards_are_reported_and_the_turn_reward_is_what_advantages_use():
    rng = np.random.default_rng(0)
    buf = ReplayBuffer("e", ReplayConfig())
    rs = [make_rollout("e", 2, 3, 1.0 - 0.3 * c, 0, rng, rewards={"correct": float(c), "len": 3.0}) for c in (1, 0, 1)]
    admission = buf.admit(RolloutGroup("e", "p", rs))
    assert admission.accepted and admission.queued == 3 and admission.sampled_tokens == 9
    np.testing.assert_allclose([it.advantage for it in buf.items], rloo(np.array([0.7, 1.0, 0.7])))
    m = buf.metrics(0)
    assert m["replays/e/rewards/correct/mean"] == pytest.approx(2 / 3)
    assert m["replays/e/rewards/len/std"] == 0.0


# ---- buffer ---------------------------------------------------------------------------------------------


def _corrupt(kind):
    def f(g):
        t = g.rollouts[0].turns
        if kind == "logprob_count":
            t[1].sampler_logprobs = t[1].sampler_logprobs[:-1]
        elif kind == "token_out_of_vocab":
            t[0].token_ids[0] = 1000
        elif kind == "nonfinite_reward":
            t[1].rewards = {"x": float("nan")}
        elif kind == "bad_logprob":
            t[1].sampler_logprobs[0] = float("-inf")
        elif kind == "unknown_environment":
            g.environment = "other"
        elif kind == "no_sampled_tokens":
            t[1].sampler_logprobs = None
        elif kind == "inconsistent_group":
            g.rollouts[1].problem_id = "q"
        elif kind == "missing_metadata":
            t[1].inference_metadata = None
        return g

    return f


@pytest.mark.parametrize(
    "reason",
    [
        "logprob_count",
        "token_out_of_vocab",
        "nonfinite_reward",
        "bad_logprob",
        "unknown_environment",
        "no_sampled_tokens",
        "inconsistent_group",
        "missing_metadata",
    ],
)
def test_buffer_rejects_each_kind_of_invalid_group_by_reason(reason, caplog):
    rng = np.random.default_rng(0)
    buf = ReplayBuffer("e", ReplayConfig(), vocab_size=100)
    with caplog.at_level(logging.WARNING):
        admission = buf.admit(_corrupt(reason)(make_group("e", 4, rng)))
    assert not admission.accepted and admission.reason == reason and admission.detail
    assert reason in caplog.text
    m = buf.metrics(0)
    assert m[f"replays/e/rejected/{reason}"] == 1 and m["replays/e/rejected"] == 1
    assert len(buf) == 0 and m["replays/e/new_rollouts"] == 0


def test_buffer_rejects_malformed_small_and_zero_variance_groups_and_counts_them():
    rng = np.random.default_rng(0)
    buf = ReplayBuffer("e", ReplayConfig(min_group_size=3, drop_zero_variance_groups=True), vocab_size=100)
    assert buf.admit(make_group("e", 2, rng)).reason == "group_too_small"
    bad = make_group("e", 4, rng).to_dict()
    del bad["rollouts"][0]["turns"]
    assert buf.admit(bad).reason == "malformed"
    flat = make_group("e", 4, rng)
    for r in flat.rollouts:
        r.turns[1].reward = 1.0
    assert buf.admit(flat).reason == "zero_variance"
    good = make_group("e", 4, rng)
    good.rollouts[0].turns[1].reward, good.rollouts[1].turns[1].reward = 0.0, 1.0
    assert buf.admit(good.to_dict()).accepted
    m = buf.metrics(0)
    assert m["replays/e/rejected/group_too_small"] == 1
    assert m["replays/e/rejected/malformed"] == 1
    assert m["replays/e/rejected/zero_variance"] == 1
    assert m["replays/e/rollouts_in_buffer"] == 4 and m["replays/e/new_rollouts"] == 4


def test_buffer_drops_stale_rollouts_in_buffer_and_on_arrival():
    rng = np.random.default_rng(1)
    buf = ReplayBuffer("e", ReplayConfig(max_age=2))
    buf.admit(make_group("e", 4, rng, version=0))
    buf.admit(make_group("e", 4, rng, version=3))
    assert buf.drop_stale(learner_version=4) == 4
    assert all(it.oldest_version == 3 for it in buf.items)
    admission = buf.admit(make_group("e", 4, rng, version=1))  # valid, but already too old for learner version 4
    assert admission.accepted and admission.discarded_stale == 4 and admission.queued == 0
    assert len(buf) == 4
    m = buf.metrics(4)
    assert m["replays/e/discarded_stale"] == 8 and m["replays/e/new_rollouts"] == 12


def test_buffer_evicts_oldest_first_past_capacity():
    rng = np.random.default_rng(2)
    buf = ReplayBuffer("e", ReplayConfig(capacity=6))
    groups = [make_group("e", 4, rng) for _ in range(3)]
    for g in groups:
        buf.admit(g)
    kept = [it.rollout.rollout_uid for it in buf.items]
    assert kept == [r.rollout_uid for r in groups[1].rollouts[2:] + groups[2].rollouts]
    assert buf.metrics(0)["replays/e/evicted"] == 6


def test_buffer_metrics_are_reads_that_cover_the_window_since_it_started():
    rng = np.random.default_rng(3)
    buf = ReplayBuffer("e", ReplayConfig())
    g = make_group("e", 4, rng, version=2, lens=(3, 5))
    g.rollouts[0].turns[1].inference_metadata.finish_reason = "length"
    buf.admit(g)
    m = buf.metrics(2)
    assert buf.metrics(2) == m  # reading changes nothing
    assert m["replays/e/new_tokens"] == 32 and m["replays/e/new_generated_tokens"] == 20
    assert m["replays/e/tokens_in_buffer"] == 32 and m["replays/e/frac_on_policy"] == 1.0
    assert m["replays/e/frac_truncated"] == 0.25
    assert m["replays/e/reward/mean"] == pytest.approx(np.mean([r.reward for r in g.rollouts]))
    buf.start_window()
    m = buf.metrics(3)
    assert m["replays/e/new_rollouts"] == 0 and m["replays/e/frac_on_policy"] == 0.0


# ---- packing --------------------------------------------------------------------------------------------


def _segments(batch):
    """{(row, segment): token tuple} of a packed batch, checking contiguity and positions on the way."""
    out = {}
    for r in range(batch.num_rows):
        seg = batch.segment_ids[r]
        ids = np.unique(seg[seg >= 0])
        np.testing.assert_array_equal(ids, np.arange(len(ids)))  # numbered 0.. in order
        real = np.flatnonzero(seg >= 0)
        if real.size:  # real tokens form a prefix of the row; padding has no loss
            assert real[-1] == real.size - 1
        assert not batch.loss_mask[r, seg < 0].any()
        for s in ids:
            idx = np.flatnonzero(seg == s)
            assert np.all(np.diff(idx) == 1)
            np.testing.assert_array_equal(batch.position_ids[r, idx], np.arange(len(idx)))
            out[(r, int(s))] = tuple(batch.input_ids[r, idx])
    return out


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 64), min_size=1, max_size=60), rows=st.integers(1, 8))
def test_packing_loses_and_duplicates_nothing(lengths, rows):
    rng = np.random.default_rng(len(lengths))
    seqs = [Sequence.supervised(rng.integers(4, 50, 1).tolist(), rng.integers(4, 50, n - 1).tolist()) for n in lengths]
    batch, placed = pack(seqs, rows, 64)
    segs = _segments(batch)
    assert len(segs) == len(placed)
    assert sorted(segs.values()) == sorted(tuple(seqs[i].token_ids) for i in placed)
    # whatever was left out could not have fit in the remaining space
    free = [64 - int((batch.segment_ids[r] >= 0).sum()) for r in range(rows)]
    for i in set(range(len(seqs))) - set(placed):
        assert len(seqs[i]) > max(free)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=80), rows=st.integers(1, 10))
def test_pack_rows_is_never_worse_than_ffd_or_bfd(lengths, rows):
    def placed(a):
        return sum(n for n, r in zip(lengths, a, strict=True) if r is not None)

    a = pack_rows(lengths, rows, 100)
    assert placed(a) >= placed(first_fit_decreasing(lengths, rows, 100))
    assert placed(a) >= placed(best_fit_decreasing(lengths, rows, 100))
    for r in range(rows):
        assert sum(n for n, x in zip(lengths, a, strict=True) if x == r) <= 100


def test_first_fit_decreasing_is_optimal_on_easy_case():
    assert first_fit_decreasing([32, 32, 32, 32], 2, 64) == [0, 0, 1, 1]
    assert first_fit_decreasing([40, 30, 24, 34], 2, 64) == [0, 1, 0, 1]
    assert best_fit_decreasing([50, 40, 14, 10], 2, 64) == [0, 1, 0, 1]


# ---- batcher --------------------------------------------------------------------------------------------


def _fill(bufs, rng, version, tokens, mean_len, group_size=4):
    """Add groups to every buffer until it holds `tokens[env]` new tokens (lengths ~ log-normal)."""
    for env, buf in bufs.items():
        added = 0
        while added < tokens[env]:
            rs = []
            for _ in range(group_size):
                n = int(np.clip(rng.lognormal(np.log(mean_len[env]), 0.8), 2, 80))
                p = max(1, n // 3)
                rs.append(
                    make_rollout(
                        env, p, n - p, float(rng.integers(0, 2)), max(0, version - int(rng.integers(0, 3))), rng
                    )
                )
            buf.admit(RolloutGroup(env, "p", rs))
            added += sum(r.num_tokens for r in rs)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    raw=st.lists(st.floats(0.0, 1.0), min_size=3, max_size=3),
    total=st.floats(0.3, 1.0),
    max_age=st.integers(0, 2),
    max_reuse=st.integers(1, 3),
    remainder=st.sampled_from(["proportional", "by_fraction", "none"]),
    supply=st.floats(0.5, 2.5),
)
def test_batcher_properties_over_random_groups(seed, raw, total, max_age, max_reuse, remainder, supply):
    rng = np.random.default_rng(seed)
    names = ("a", "b", "c")
    fr = np.asarray(raw) + 1e-3
    fractions = dict(zip(names, (fr / fr.sum() * total).tolist(), strict=True))
    bufs = {n: ReplayBuffer(n, ReplayConfig(max_age=max_age, max_reuse=max_reuse)) for n in names}
    cfg = BatcherConfig(total_token_budget=512, max_seq_len=64, min_fill=0.5, remainder=remainder, too_long="drop")
    batcher = Batcher(cfg, bufs, fractions)
    mean_len = {"a": 8, "b": 20, "c": 40}
    uses: dict[str, int] = {}
    emitted = 0
    for version in range(6):
        _fill(bufs, rng, version, {n: supply * fractions[n] * 512 for n in names}, mean_len)
        by_uid = {it.rollout.rollout_uid: it for b in bufs.values() for it in b.items}
        made = batcher.try_make_batch(version)
        if isinstance(made, BatchWait):
            assert made.missing
            assert all(bufs[n].num_tokens < 0.5 * fractions[n] * 512 for n in made.missing)
            continue
        assert isinstance(made, FormedBatch)
        emitted += 1
        batch, m, placed = made.batch, made.metrics, made.placed
        assert {n: u.rollouts for n, u in made.usage.items()} == {n: m[f"batches/{n}/rollouts_used"] for n in names}
        # packing: each placed rollout appears exactly once, whole, at its row; nothing else is in the batch
        segs = _segments(batch)
        assert sorted(segs.values()) == sorted(tuple(it.rollout.token_ids) for it, _ in placed)
        assert len(segs) == len(placed) == m["batches/rollouts"]
        for it, row in placed:
            assert tuple(it.rollout.token_ids) in {v for (r, _), v in segs.items() if r == row}
        # staleness: no token older than max_age is trained on
        assert (batch.token_versions[batch.loss_mask] >= version - max_age).all()
        assert m["batches/staleness/max"] <= max_age
        # reuse
        for it, _ in placed:
            uid = it.rollout.rollout_uid
            uses[uid] = uses.get(uid, 0) + 1
            assert uses[uid] <= max_reuse
            assert uid in by_uid
        # shares: never above target; below it by more than one rollout only if none of the env's unused
        # rollouts fits into the space left (neither the largest free gap nor the remaining deficit)
        free = cfg.max_seq_len - (batch.segment_ids >= 0).sum(axis=1)
        in_batch = {id(it) for it, _ in placed}
        for n in names:
            target, got = m[f"batches/{n}/target_tokens"], m[f"batches/{n}/tokens_used"]
            assert (
                target
                >= min(
                    fractions[n] * 512,
                    by_uid and sum(it.num_tokens for it in by_uid.values() if it.rollout.environment == n),
                )
                - 1e-6
                or remainder == "none"
            )
            mine = [it.num_tokens for it, _ in placed if it.rollout.environment == n]
            assert got <= target + 1e-6 or got - max(mine) < target  # above target by less than one rollout
            assert m[f"batches/{n}/tokens_used"] == sum(
                it.num_tokens for it, _ in placed if it.rollout.environment == n
            )
            left = [it for it in bufs[n].items if id(it) not in in_batch]
            for it in left:
                assert it.num_tokens > free.max() or got >= target
        assert abs(sum(m[f"batches/{n}/target_tokens"] for n in names)) <= 512 + 1e-6
    if supply >= 1.2 and max_age >= 2:
        assert emitted >= 5  # with enough fresh data the batcher does not block


def test_env_targets_fill_the_remainder_by_the_configured_strategy():
    fr = {"a": 0.25, "b": 0.25}
    avail = {"a": 1000, "b": 300}
    assert env_targets(fr, 1000, avail, "none") == {"a": 250, "b": 250}
    assert env_targets(fr, 1000, avail, "by_fraction") == pytest.approx({"a": 500, "b": 500})
    # proportional to what each has beyond its share (750 and 50), capped by it
    assert env_targets(fr, 1000, avail, "proportional") == pytest.approx(
        {"a": 250 + 500 * 750 / 800, "b": 250 + 500 * 50 / 800}
    )
    # too little beyond the shares to fill the remainder: each gives all it has
    assert env_targets(fr, 1000, {"a": 300, "b": 400}, "proportional") == pytest.approx({"a": 300, "b": 400})
    # shortfall filled by the others
    assert env_targets({"a": 0.5, "b": 0.5}, 1000, {"a": 100, "b": 5000}, "none", True) == pytest.approx(
        {"a": 100, "b": 900}
    )


def test_batcher_reaches_each_share_within_one_rollout_when_data_is_plentiful():
    rng = np.random.default_rng(7)
    names = ("a", "b", "c")
    bufs = {n: ReplayBuffer(n, ReplayConfig(max_age=10)) for n in names}
    fractions = {"a": 0.5, "b": 0.3, "c": 0.2}
    _fill(bufs, rng, 5, {n: 3 * 4096 for n in names}, {"a": 6, "b": 12, "c": 30})
    batcher = Batcher(BatcherConfig(total_token_budget=4096, max_seq_len=128), bufs, fractions)
    made = batcher.try_make_batch(5)
    m = made.metrics
    for n, f in fractions.items():
        longest = max(it.num_tokens for it in bufs[n].items)
        assert abs(m[f"batches/{n}/tokens_used"] - f * 4096) < longest
    assert m["batches/packing_efficiency"] >= 0.97


def test_batcher_waits_says_for_which_env_and_times_out(caplog):
    rng = np.random.default_rng(0)
    bufs = {n: ReplayBuffer(n, ReplayConfig()) for n in ("a", "b")}
    bufs["a"].admit(make_group("a", 8, rng))
    cfg = BatcherConfig(total_token_budget=128, max_seq_len=32, block_timeout_s=0.2, wait_log_min_s=0.05)
    batcher = Batcher(cfg, bufs)
    with caplog.at_level(logging.INFO):
        wait = batcher.try_make_batch(0)
        assert isinstance(wait, BatchWait) and wait.missing == {"b": math.ceil(0.9 * 64)}
        assert "batcher: waiting" not in caplog.text  # a short wait is the loop's normal rhythm: no line
        time.sleep(0.06)
        batcher.try_make_batch(0)
    assert caplog.text.count("batcher: waiting") == 1 and "b (58 tokens missing" in caplog.text
    time.sleep(0.2)
    with pytest.raises(BatchTimeoutError, match="b \\(58 tokens missing"):
        batcher.try_make_batch(0)


def test_batcher_says_nothing_about_waits_shorter_than_the_threshold(caplog):
    rng = np.random.default_rng(0)
    bufs = {n: ReplayBuffer(n, ReplayConfig()) for n in ("a", "b")}
    bufs["a"].admit(make_group("a", 8, rng))
    batcher = Batcher(BatcherConfig(total_token_budget=128, max_seq_len=32), bufs)  # default threshold: 5 s
    with caplog.at_level(logging.INFO):
        for _ in range(20):
            assert isinstance(batcher.try_make_batch(0), BatchWait)
        bufs["b"].admit(make_group("b", 8, rng))
        assert isinstance(batcher.try_make_batch(0), FormedBatch)
    assert "batcher: waiting" not in caplog.text


def test_batcher_fill_policy_lets_other_envs_cover_a_shortfall():
    rng = np.random.default_rng(0)
    bufs = {n: ReplayBuffer(n, ReplayConfig()) for n in ("a", "b")}
    for _ in range(8):
        bufs["a"].admit(make_group("a", 4, rng))
    bufs["b"].admit(make_group("b", 2, rng))
    batcher = Batcher(BatcherConfig(total_token_budget=256, max_seq_len=32, shortfall="fill"), bufs)
    made = batcher.try_make_batch(0)
    assert isinstance(made, FormedBatch)
    m = made.metrics
    assert m["batches/b/tokens_used"] == 16 and m["batches/a/tokens_used"] == 240
    assert m["batches/packing_efficiency"] == pytest.approx(1.0)


def test_too_long_rollouts_are_dropped_or_truncated_on_admission():
    rng = np.random.default_rng(0)
    for policy in ("drop", "truncate"):
        buf = ReplayBuffer("a", ReplayConfig(), max_tokens=32, too_long=policy)
        g = make_group("a", 4, rng, lens=(10, 10))
        g.rollouts[0] = make_rollout("a", 20, 30, 1.0, 0, rng)  # 50 tokens: sampled ones survive a cut at 32
        g.rollouts[1] = make_rollout("a", 40, 5, 0.0, 0, rng)  # only prompt survives: always dropped
        admission = buf.admit(g)
        batcher = Batcher(BatcherConfig(total_token_budget=128, max_seq_len=32, min_fill=0.1), {"a": buf})
        made = batcher.try_make_batch(0)
        segs = sorted(_segments(made.batch).values(), key=len)
        m = buf.metrics(0)
        if policy == "drop":
            assert admission.dropped_too_long == 2 and admission.queued == 2 and len(segs) == 2
            assert m["replays/a/dropped/too_long"] == 2 and m["replays/a/truncated_too_long"] == 0
        else:
            assert admission.dropped_too_long == 1 and admission.truncated_too_long == 1 and admission.queued == 3
            assert m["replays/a/dropped/too_long"] == 1 and m["replays/a/truncated_too_long"] == 1
            assert segs[-1] == tuple(g.rollouts[0].token_ids[:32])
            cut = next(it for it, _ in made.placed if it.max_len is not None)
            assert cut.num_tokens == 32 and cut.rollout.num_tokens == 50  # the stored rollout is whole
            row = next(r for it, r in made.placed if it is cut)
            seg = made.batch.segment_ids[row] == next(
                s for s in range(4) if tuple(made.batch.input_ids[row, made.batch.segment_ids[row] == s]) == segs[-1]
            )
            assert made.batch.loss_mask[row, seg].sum() == 12  # the 12 sampled tokens that survive the cut


def test_batcher_rejects_shares_that_do_not_match_envs():
    with pytest.raises(ValueError, match="do not match"):
        Batcher(BatcherConfig(), {"a": ReplayBuffer("a", ReplayConfig())}, {"b": 1.0})
    with pytest.raises(ValueError, match="batcher.too_long"):
        BatcherConfig(too_long="wrap")


def test_remax_advantages_are_rewards_minus_the_greedy_reward_carried_by_the_group():
    rng = np.random.default_rng(7)
    buf = ReplayBuffer("e", ReplayConfig(advantage_estimator="remax"), vocab_size=100)
    group = make_group("e", 4, rng)
    assert buf.admit(group).reason == "no_greedy_baseline"  # sampled without the greedy episode
    group.baseline_reward = 0.25
    back = RolloutGroup.from_dict(group.to_dict())  # the baseline travels with the group (env actor -> driver)
    assert back.baseline_reward == 0.25 and "baseline_reward" not in make_group("e", 2, rng).to_dict()
    assert buf.admit(back.to_dict()).accepted
    rewards = np.array([r.reward for r in group.rollouts])
    np.testing.assert_allclose([it.advantage for it in buf.items], rewards - 0.25)
    with pytest.raises(ValueError, match="greedy baseline"):
        GroupAdvantages("remax")(rewards)
