"""Curricula: the environments' batch shares on a schedule over learner steps (`marin_rl.replay.schedule`) and the
pass-rate problem sampler (`marin_rl.envs.difficulty`). Values against hand-computed references, validation in one
line, determinism, exact state round trips, and a SIGKILLed curriculum run resumed exactly."""

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import yaml
from deterministic_run import deterministic_config
from test_local_backend import _finish, _start, _without_ray
from test_replay import make_group
from test_resume import _markers, _reap_session, _signal_when, _stop_all

from marin_rl.config import RunConfig
from marin_rl.envs.difficulty import BUCKETS, PassRateConfig, PassRateSampler, problem_order
from marin_rl.envs.iteration import ProblemIterator, stream_id
from marin_rl.replay.batcher import Batcher, BatcherConfig, FormedBatch
from marin_rl.replay.buffer import ReplayBuffer, ReplayConfig
from marin_rl.replay.schedule import FractionSchedule
from marin_rl.replay.store import read_rollouts
from marin_rl.rollouts.staleness import RolloutsPerBatch
from marin_rl.run import parse_config
from marin_rl.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "marin_rl: invalid configuration: "


# ---- the fraction schedule -----------------------------------------------------------------------------------
def test_schedule_interpolates_linearly_between_points_and_holds_outside_them():
    schedule = FractionSchedule(
        ["a", "b", "c", "d"],
        scheduled={"a": [(10, 0.6), (30, 0.2)], "b": [(0, 0.1), (20, 0.5), (30, 0.3)]},
        fixed={"c": 0.1},
    )
    # by hand: a is 0.6 until step 10, then falls 0.02 a step to 0.2 at 30; b rises 0.02 a step to 0.5 at 20, then
    # falls 0.02 a step to 0.3 at 30; d (free) gets what a, b and c leave
    expected = {
        0: (0.6, 0.1),
        5: (0.6, 0.2),
        10: (0.6, 0.3),
        15: (0.5, 0.4),
        20: (0.4, 0.5),
        25: (0.3, 0.4),
        30: (0.2, 0.3),
        100: (0.2, 0.3),
    }
    for step, (a, b) in expected.items():
        shares = schedule.at(step)
        assert list(shares) == ["a", "b", "c", "d"]
        np.testing.assert_allclose([shares["a"], shares["b"], shares["c"]], [a, b, 0.1], atol=1e-12, err_msg=step)
        np.testing.assert_allclose(shares["d"], max(0.0, 1 - a - b - 0.1), atol=1e-12, err_msg=step)
    assert schedule.varies and not FractionSchedule.constant({"a": 0.5, "b": 0.5}).varies


def test_without_a_curriculum_the_shares_are_the_fixed_ones_at_every_step():
    config = RunConfig()
    config.envs = [
        type(config.envs[0])(name="x", fraction=0.3),
        type(config.envs[0])(name="y"),
        type(config.envs[0])(name="z"),
    ]
    schedule = config.fraction_schedule()
    assert not schedule.varies
    for step in (0, 1, 7, 1000):
        assert schedule.at(step) == {"x": 0.3, "y": 0.7 / 2, "z": 0.7 / 2}  # the formula env_fractions always had


def _refusal(tmp_path: Path, curriculum: dict, fraction: float | None = None, second_env: bool = True) -> str:
    doc = yaml.safe_load((ROOT / "experiments" / "quickstart.yaml").read_text())
    if second_env:
        doc["envs"].append({**doc["envs"][0], "name": "sums"})
    if fraction is not None:
        doc["envs"][0]["fraction"] = fraction
    doc["curriculum"] = curriculum
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(SystemExit) as exc:
        parse_config(["--config", str(path)])
    message = str(exc.value)
    assert "\n" not in message and message.startswith(PREFIX), message
    return message[len(PREFIX) :]


@pytest.mark.parametrize(
    "curriculum,fraction,expected",
    [
        (
            {"fractions": {"adition": [[0, 0.5]]}},
            None,
            "curriculum.fractions names ['adition'], which are not environments (known: ['addition', 'sums'])",
        ),
        (
            {"fractions": {"addition": [[0, 0.2], [10, 0.9]], "sums": [[0, 0.8], [20, 0.1]]}},
            None,
            "curriculum.fractions: the shares sum to 1.35 > 1 at step 10 (addition 0.9, sums 0.45)",
        ),
        (
            {"fractions": {"addition": [[0, 0.5], [10, 0.6], [10, 0.7]]}},
            None,
            "curriculum.fractions[addition]: steps must increase, got 10 after 10",
        ),
        (
            {"fractions": {"addition": [[5, 0.5], [3, 0.6]]}},
            None,
            "curriculum.fractions[addition]: steps must increase, got 3 after 5",
        ),
        (
            {"fractions": {"sums": [[0, 1.5]]}},
            None,
            "curriculum.fractions[sums]: a fraction must be in [0, 1], got 1.5 at step 0",
        ),
        ({"fractions": {"sums": []}}, None, "curriculum.fractions[sums]: needs at least one [step, fraction] point"),
        (
            {"fractions": {"sums": [[0, 0.2]]}},
            0.9,
            "curriculum.fractions: the shares sum to 1.1 > 1 at step 0 (addition 0.9, sums 0.2)",
        ),
        (
            {"fractions": {"addition": [[0, 0.2]]}},
            0.5,
            "envs[addition] has both a fraction and a schedule in curriculum.fractions: set one",
        ),
        ({"problems": "hardest"}, None, "curriculum.problems must be one of ('order', 'pass_rate'), got 'hardest'"),
        (
            {"pass_rate": {"low": 0.6, "high": 0.4}},
            None,
            "curriculum.pass_rate.high: must be >= curriculum.pass_rate.low (0.6), got 0.4",
        ),
        (
            {"pass_rate": {"pass_reward": {"sum": 3.0}}},
            None,
            "curriculum.pass_rate.pass_reward names ['sum'], which are not environments (known: ['addition', 'sums'])",
        ),
    ],
)
def test_a_bad_curriculum_is_refused_in_one_line_naming_it(tmp_path, curriculum, fraction, expected):
    assert _refusal(tmp_path, curriculum, fraction) == expected


def test_validation_leaves_the_curriculum_as_it_was(tmp_path):
    doc = yaml.safe_load((ROOT / "experiments" / "curriculum.yaml").read_text())
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    config = parse_config(["--config", str(path)])
    before = json.dumps(config.curriculum.fractions, sort_keys=True)
    config.validate()
    assert json.dumps(config.curriculum.fractions, sort_keys=True) == before
    assert config.curriculum.fractions == {"addition": [(0, 0.7), (100, 0.3)], "running_sum": [(0, 0.3), (100, 0.7)]}
    assert config.problem_sampling() is config.curriculum.pass_rate


def _buffers(rng, names=("a", "b"), groups=40):
    buffers = {n: ReplayBuffer(n, ReplayConfig(max_age=100, min_group_size=2)) for n in names}
    for n, buf in buffers.items():
        for _ in range(groups):
            buf.admit(make_group(n, 4, rng, lens=(3, 5)))
    return buffers


def test_the_batcher_targets_the_shares_of_the_step_that_trains_the_batch():
    rng = np.random.default_rng(0)
    schedule = FractionSchedule(["a", "b"], scheduled={"a": [(0, 0.75), (10, 0.25)], "b": [(0, 0.25), (10, 0.75)]})
    cfg = BatcherConfig(total_token_budget=512, max_seq_len=64, remainder="none")
    batcher = Batcher(cfg, _buffers(rng), schedule=schedule)
    for version, a_share in ((0, 0.75 - 0.05), (4, 0.75 - 0.25), (20, 0.25)):  # batch of version v trains step v + 1
        formed = batcher.try_make_batch(version)
        assert isinstance(formed, FormedBatch)
        assert formed.metrics["batches/a/fraction"] == pytest.approx(a_share)
        assert formed.metrics["batches/b/fraction"] == pytest.approx(1 - a_share)
        assert formed.usage["a"].target_tokens == pytest.approx(a_share * 512)
        assert formed.usage["b"].target_tokens == pytest.approx((1 - a_share) * 512)
        # each environment ends within one rollout (8 tokens) of its target
        assert abs(formed.usage["a"].tokens - a_share * 512) <= 8


def test_the_gate_estimate_follows_a_changing_share_and_is_checkpointed():
    estimate = RolloutsPerBatch(tokens_per_batch=400, initial_rollout_tokens=20)
    assert estimate.value == 20
    estimate.observe_batch(16)
    estimate.set_share(100)  # a quarter of the share: a quarter of the rollouts
    assert estimate.value == 4
    state = json.loads(json.dumps(estimate.state_dict()))
    estimate.set_share(0)
    assert estimate.value == 1  # at least one
    estimate.set_share(200)  # from nothing, the token estimate again: 200 / 20
    assert estimate.measured is None and estimate.value == 10
    restored = RolloutsPerBatch(tokens_per_batch=400, initial_rollout_tokens=20)
    restored.load_state_dict(state)
    restored.set_share(200)
    assert restored.value == 8 and restored.tokens_per_batch == 200


# ---- the pass-rate sampler -----------------------------------------------------------------------------------
def _config(**kw) -> PassRateConfig:
    return PassRateConfig(**{"low": 0.2, "high": 0.8, "smoothing": 0.5, **kw})


def test_pass_rates_are_moving_averages_and_weights_follow_the_buckets():
    cfg = _config(unseen_weight=0.7, easy_weight=0.05, hard_weight=0.25)
    sampler = PassRateSampler(6, seed=1, stream=2, config=cfg, pass_reward=1.0)
    tickets = [sampler.next() for _ in range(6)]
    assert sorted(t.index for t in tickets) == list(range(6)), "without replacement within a batch"
    by_index = {t.index: t for t in tickets}
    # group rewards per problem, two rounds; pass = reward >= 1
    rounds = [
        {0: [1, 1, 1, 1], 1: [0, 0, 0, 0], 2: [1, 0, 0, 0], 3: [1, 1, 0, 0.5]},
        {0: [1, 1, 1, 0], 1: [0, 0, 0, 0], 2: [1, 1, 1, 1], 4: [0, 0, 1, 2]},
    ]
    for index in (5,):
        sampler.requeue(by_index[index])  # a failed group reports nothing
    for index, rewards in rounds[0].items():
        sampler.done(by_index[index], rewards)
    sampler.done(by_index[4])  # delivered but unreadable: nothing reported
    sampler.refresh()
    second = {}
    while len(second) < 4:  # draw until problems 0, 1, 2, 4 are handed out again (5 comes first: requeued)
        t = sampler.next()
        if t.index in rounds[1] and t.index not in second:
            second[t.index] = t
        else:
            sampler.done(t)
    for index, rewards in rounds[1].items():
        sampler.done(second[index], rewards)
    sampler.refresh()
    # by hand: first group sets the rate, then p <- 0.5 p + 0.5 new
    expected_rate = {0: 0.5 * 1.0 + 0.5 * 0.75, 1: 0.0, 2: 0.5 * 0.25 + 0.5 * 1.0, 3: 0.5, 4: 0.5}
    for index, rate in expected_rate.items():
        assert sampler.pass_rate[index] == pytest.approx(rate), index
    assert sampler.reported.tolist() == [2, 2, 2, 1, 1, 0]
    # buckets: 0 (0.875) easy, 1 (0) hard, 2 (0.625) learnable, 3 and 4 (0.5) learnable, 5 unseen
    assert [BUCKETS[c] for c in sampler.buckets()] == ["easy", "hard", "learnable", "learnable", "learnable", "unseen"]
    np.testing.assert_allclose(sampler.weights(), [0.05, 0.25, 1.0, 1.0, 1.0, 0.7])
    metrics = sampler.metrics("e")
    assert metrics["problems/e/learnable/count"] == 3 and metrics["problems/e/unseen/count"] == 1
    assert metrics["problems/e/learnable/pass_rate"] == pytest.approx((0.625 + 0.5 + 0.5) / 3)
    assert metrics["problems/e/easy/pass_rate"] == pytest.approx(0.875)
    assert "problems/e/unseen/pass_rate" not in metrics
    assert sum(metrics[f"problems/e/{b}/draw_frac"] == 0 for b in BUCKETS) <= 3


def test_problems_are_drawn_in_proportion_to_their_weights():
    cfg = _config(unseen_weight=2.0, easy_weight=0.5, hard_weight=0.0)
    sampler = PassRateSampler(5, seed=0, stream=0, config=cfg)
    handed = [sampler.next() for _ in range(5)]
    rates = {0: [1, 1, 1, 1], 1: [0, 0, 0, 0], 2: [1, 1, 0, 0], 3: [1, 1, 1, 0]}  # easy, hard, learnable, learnable
    for t in handed:
        sampler.done(t, rates.get(t.index, ()))
    sampler.refresh()  # problem 4 stays unseen (its group reported nothing)
    weights = np.array([0.5, 0.0, 1.0, 1.0, 2.0])
    np.testing.assert_allclose(sampler.weights(), weights)
    sampler.metrics("e")  # the draw shares count from here
    counts = np.zeros(5)
    n = 20_000
    for _ in range(n):
        t = sampler.next()
        counts[t.index] += 1
        sampler.done(t)
        sampler.refresh()  # every draw from the full weights
    np.testing.assert_allclose(counts / n, weights / weights.sum(), atol=0.015)
    assert counts[1] == 0, "a hard problem of weight 0 is never drawn while others have weight"
    metrics = sampler.metrics("e")
    assert metrics["problems/e/hard/draw_frac"] == 0
    assert metrics["problems/e/unseen/draw_frac"] == pytest.approx(counts[4] / n)


def test_between_refreshes_problems_are_drawn_without_replacement_then_with_it():
    sampler = PassRateSampler(4, seed=5, stream=0, config=_config())
    first = [sampler.next().index for _ in range(4)]
    assert sorted(first) == [0, 1, 2, 3]
    more = [sampler.next() for _ in range(3)]  # every problem already drawn: with replacement
    assert len({t.epoch for t in more}) == 3 and all(0 <= t.index < 4 for t in more)
    assert [t.epoch for t in more] == [4, 5, 6], "tickets are numbered by draw"


def test_the_sampler_is_a_function_of_seed_and_reported_history():
    def run(seed: int) -> list[tuple[int, int]]:
        sampler = PassRateSampler(30, seed=seed, stream=stream_id("addition"), config=_config())
        out = []
        rng = np.random.default_rng(0)  # the same reported results each time
        for _ in range(6):
            tickets = [sampler.next() for _ in range(7)]
            out += [(t.index, t.epoch) for t in tickets]
            for t in tickets:
                sampler.done(t, rng.integers(0, 2, 4).tolist())
            sampler.refresh()
        return out

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_state_round_trip_mid_stream_continues_the_uninterrupted_sequence():
    def step(sampler, tickets, rng):
        for t in tickets:
            sampler.done(t, rng.integers(0, 2, 4).tolist())

    sampler = PassRateSampler(12, seed=7, stream=1, config=_config(easy_weight=0.02, hard_weight=0.02))
    rng = np.random.default_rng(1)
    for _ in range(3):  # three batches' worth of results
        step(sampler, [sampler.next() for _ in range(5)], rng)
        sampler.refresh()
    handed = [sampler.next() for _ in range(5)]
    step(sampler, handed[:2], rng)  # reported, not yet applied (pending at the checkpoint)
    sampler.requeue(handed[2])  # failed: first in line
    # outstanding at the checkpoint: handed[3], handed[4]
    state = json.loads(json.dumps(sampler.state_dict()))
    results = np.random.default_rng(2).integers(0, 2, (40, 4)).tolist()

    def finish(s, redo_first: bool) -> list:
        """Hand out the redo (or, uninterrupted, the same tickets again), report in order, and go on 3 batches."""
        out = []
        if redo_first:
            redo = [s.next() for _ in range(3)]
            assert redo == [handed[2], handed[3], handed[4]], "requeued, then in flight, in hand-out order"
        else:
            redo = [s.next()]  # the requeued one; handed[3], handed[4] are still out
            redo += [handed[3], handed[4]]
        k = 0
        for t in redo:
            s.done(t, results[k])
            k += 1
        s.refresh()
        for _ in range(3):
            tickets = [s.next() for _ in range(5)]
            out += tickets
            for t in tickets:
                s.done(t, results[k])
                k += 1
            s.refresh()
        return out + [s.state_dict()]

    reference = finish(sampler, redo_first=False)
    resumed = PassRateSampler(12, seed=7, stream=1, config=_config(easy_weight=0.02, hard_weight=0.02))
    resumed.load_state_dict(state)
    assert resumed.sample_seed(handed[3]) == sampler.sample_seed(handed[3]), "a redone problem keeps its seed"
    again = finish(resumed, redo_first=True)
    assert again[:-1] == reference[:-1]
    for key in ("draws", "stats", "pending", "drawn", "window"):
        assert again[-1][key] == reference[-1][key], key


def test_a_checkpoint_of_the_other_order_is_refused():
    order_state = ProblemIterator(10, seed=0).state_dict()
    with pytest.raises(ValueError, match="'order' sampler but this run uses 'pass_rate'"):
        PassRateSampler(10, seed=0, stream=0, config=_config()).load_state_dict(order_state)
    sampler_state = PassRateSampler(10, seed=0, stream=0, config=_config()).state_dict()
    with pytest.raises(ValueError, match="'pass_rate' sampler but this run uses 'order'"):
        ProblemIterator(10, seed=0).load_state_dict(sampler_state)


def test_without_a_sampler_the_problem_order_is_the_seeded_shuffle():
    plain = ProblemIterator(17, seed=3, stream=stream_id("addition"))
    order = problem_order(17, 3, "addition", None)
    assert type(order) is ProblemIterator
    assert [order.next() for _ in range(40)] == [plain.next() for _ in range(40)]
    assert order.metrics("addition") == {}


def test_admission_reports_the_rewards_of_groups_the_filters_reject_too():
    rng = np.random.default_rng(0)
    buffer = ReplayBuffer("a", ReplayConfig(drop_zero_variance_groups=True, min_group_size=2))
    group = make_group("a", 4, rng)
    for r, reward in zip(group.rollouts, [1.0, 0.0, 1.0, 1.0], strict=True):
        r.turns[-1].reward = reward
    accepted = buffer.admit(group)
    assert accepted.accepted and accepted.rewards == (1.0, 0.0, 1.0, 1.0)
    solved = make_group("a", 4, rng)
    for r in solved.rollouts:
        r.turns[-1].reward = 1.0
    rejected = buffer.admit(solved)
    assert not rejected.accepted and rejected.reason == "zero_variance" and rejected.rewards == (1.0,) * 4
    # DAPO's dynamic sampling rejects the same uninformative groups after scoring: the sampler still learns from them
    dynamic = ReplayBuffer("a", ReplayConfig(dynamic_sampling=True, min_group_size=2))
    unsolved = make_group("a", 4, rng)
    for r in unsolved.rollouts:
        r.turns[-1].reward = 0.0
    rejected = dynamic.admit(unsolved)
    assert not rejected.accepted and rejected.reason == "zero_advantage" and rejected.rewards == (0.0,) * 4


# ---- a curriculum run, SIGKILLed and resumed -------------------------------------------------------------------
def _curriculum_config(out: Path, steps: int, every: int) -> Path:
    """The deterministic test run with a second environment (the running sum), a share schedule and the pass-rate
    sampler."""
    path = deterministic_config(out, steps, every, warm_start_steps=20, eval_problems=4, backend="local")
    cfg = yaml.safe_load(path.read_text())
    second = {**cfg["envs"][0], "name": "running_sum"}
    second.update(
        env_class="marin_rl.envs.running_sum:RunningSumEnvironment",
        args={"num_terms": 3, "max_term": 9, "num_eval": 10, "demo_error_rate": 0.4},
    )
    cfg["envs"].append(second)
    cfg["curriculum"] = {
        "fractions": {"addition": [[0, 0.8], [steps, 0.2]], "running_sum": [[0, 0.2], [steps, 0.8]]},
        "problems": "pass_rate",
        "pass_rate": {"pass_reward": {"running_sum": 2.0}},
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _problem_sequence(output: Path, env: str) -> list[str]:
    """The problems of the accepted groups along the surviving timeline, in the order they were accepted."""
    stored = read_rollouts(str(output / "rollouts" / env))
    assert stored.errors == []
    groups = {s.group_index: s.rollout.problem_id for s in stored.rollouts}
    return [groups[i] for i in sorted(groups)]


@pytest.mark.slow
def test_curriculum_run_killed_with_sigkill_resumes_with_the_same_schedule_and_problems(tmp_path):
    """Two environments on a share schedule with the pass-rate sampler, deterministic, local backend: a run
    SIGKILLed after a checkpoint and a later step, resumed to the end, has the uninterrupted run's shares, bucket
    statistics, problem order and losses at every step."""
    steps, every = 6, 2
    ref_cfg = _curriculum_config(tmp_path / "reference", steps, every)
    cfg = _curriculum_config(tmp_path / "killed", steps, every)
    ref_log, log, out = tmp_path / "reference.log", tmp_path / "killed.log", tmp_path / "killed"
    env = _without_ray(tmp_path)
    reference = _start(ref_cfg, ref_log, env)
    procs = [reference]
    try:
        proc = _start(cfg, log, env)
        procs.append(proc)
        saved, killed_after = _signal_when(proc, log, out, signal.SIGKILL, lambda s, last: s and last > max(s))
        proc.wait()
        _reap_session(proc.pid)
        proc = _start(cfg, log, env)
        procs.append(proc)
        _finish(proc, log, 400)
        _finish(reference, ref_log, 400)
    finally:
        _stop_all(procs)
    assert [m["step"] for m in _markers(out)] == [max(saved)] and max(saved) < killed_after < steps
    rows = read_metrics(str(out / "metrics.jsonl"))
    ref_rows = read_metrics(str(tmp_path / "reference" / "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(steps + 1)) == [r["step"] for r in ref_rows]
    for r, ref in zip(rows[1:], ref_rows[1:], strict=True):
        step = r["step"]
        # the schedule: the shares at the step, as interpolated by hand
        assert r["batches/addition/fraction"] == pytest.approx(0.8 - 0.6 * step / steps)
        assert r["batches/running_sum/fraction"] == pytest.approx(0.2 + 0.6 * step / steps)
        bucket_keys = [k for k in ref if k.startswith("problems/")]
        assert len(bucket_keys) >= 2 * 2 * len(BUCKETS), "counts and draw shares per bucket and environment"
        for key in ["batches/rollouts", "batches/addition/tokens_used", "batches/running_sum/tokens_used"]:
            assert r[key] == ref[key], (step, key)
        for key in bucket_keys:
            assert r[key] == ref[key], (step, key)
        np.testing.assert_allclose(r["learner/loss"], ref["learner/loss"], rtol=1e-5, atol=1e-7, err_msg=str(step))
    seen = [ref_rows[-1][f"problems/{e}/{b}/count"] for e in ("addition", "running_sum") for b in BUCKETS[1:]]
    assert sum(seen) > 0, "the sampler learned some pass rates"
    for name in ("addition", "running_sum"):
        assert _problem_sequence(out, name) == _problem_sequence(tmp_path / "reference", name)
    summary = json.loads((out / "summary.json").read_text())
    ref_summary = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert summary["generated_tokens"] == ref_summary["generated_tokens"], "nothing generated twice or lost"
