"""Checkpoints and exact resume: state round trips of each part, incomplete checkpoints, and a run killed with
SIGKILL and resumed that ends where an uninterrupted run ends."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from deterministic_run import deterministic_config, final_learner_arrays, stored_timeline, warm_starts
from marked_processes import dead_weight_slot_dirs, describe, marked_processes, new_mark, wait_until

from marin_rl.broadcast.shared_memory import DEFAULT_ROOT, PRIVATE_PREFIX
from marin_rl.checkpoint_dirs import (
    MARKER_FILE,
    begin_checkpoint,
    is_complete,
    latest_checkpoint,
    prune_checkpoints,
    step_path,
    write_json,
)
from marin_rl.envs.iteration import ProblemIterator, ProblemTicket
from marin_rl.learner.checkpoint import load_learner_state, save_learner_state
from marin_rl.learner.config import LearnerConfig, LossConfig
from marin_rl.learner.learner import Learner
from marin_rl.learner.optimizer import OptimizerConfig
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.replay.batcher import Batcher, BatcherConfig, FormedBatch
from marin_rl.replay.buffer import ReplayBuffer, ReplayConfig
from marin_rl.replay.packing import Sequence, pack
from marin_rl.tokenizer import build_char_tokenizer
from marin_rl.tracking import JsonlTracker, read_metrics
from marin_rl.types import InferenceMetadata, Rollout, RolloutGroup, Turn

ROOT = Path(__file__).resolve().parents[1]


# ---- problem iteration ---------------------------------------------------------------------------------------
def test_problem_iterator_visits_each_problem_once_per_epoch_in_a_seeded_order():
    it = ProblemIterator(7, seed=3, stream=1)
    tickets = [it.next() for _ in range(21)]
    for e in range(3):
        epoch = tickets[7 * e : 7 * (e + 1)]
        assert {t.epoch for t in epoch} == {e}
        assert sorted(t.index for t in epoch) == list(range(7))
    orders = [[t.index for t in tickets[7 * e : 7 * (e + 1)]] for e in range(3)]
    assert orders[0] != orders[1] or orders[1] != orders[2], "each epoch is reshuffled"
    again = ProblemIterator(7, seed=3, stream=1)
    assert [again.next() for _ in range(21)] == tickets, "the order is a function of (seed, stream)"
    other = ProblemIterator(7, seed=4, stream=1)
    assert [other.next() for _ in range(21)] != tickets


def test_problem_iterator_state_round_trip_neither_repeats_nor_skips():
    it = ProblemIterator(10, seed=0)
    handed = [it.next() for _ in range(13)]  # into the second epoch
    for t in handed[:9]:
        it.done(t)
    it.requeue(handed[11])  # failed: first in line
    # outstanding (in flight at the checkpoint): handed[9], handed[10], handed[12]
    state = json.loads(json.dumps(it.state_dict()))
    reference = [it.next() for _ in range(30)]  # what the original hands out next

    resumed = ProblemIterator(10, seed=0)
    resumed.load_state_dict(state)
    redo = [resumed.next() for _ in range(4)]
    assert redo == [handed[11], handed[9], handed[10], handed[12]], "requeued, then in-flight, in hand-out order"
    assert [resumed.next() for _ in range(26)] == [t for t in reference if t not in redo][:26]
    assert resumed.sample_seed(handed[9]) == it.sample_seed(handed[9]), "a redone problem keeps its seed"
    # every problem of epoch 1 is handed out exactly once across the interruption
    epoch1 = [t.index for t in handed[10:] if t.epoch == 1] + [
        t.index for t in redo + reference if t.epoch == 1 and t not in handed
    ]
    assert sorted(epoch1) == list(range(10))


def test_problem_iterator_refuses_a_different_problem_set():
    state = ProblemIterator(10, seed=0).state_dict()
    with pytest.raises(ValueError, match="num_problems"):
        ProblemIterator(11, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        ProblemIterator(10, seed=1).load_state_dict(state)
    with pytest.raises(KeyError):
        ProblemIterator(10, seed=0).done(ProblemTicket(0, 0))


# ---- learner -------------------------------------------------------------------------------------------------
def _learner(kl_coef=0.0, seed=0):
    tok = build_char_tokenizer()
    cfg = LearnerConfig(optimizer=OptimizerConfig(learning_rate=3e-3), loss=LossConfig(kl_coef=kl_coef))
    return tok, Learner(ModelConfig(architecture=tiny_llama(), seed=seed), cfg, len(tok))


def _batch(learner, tok, completions, advantages):
    prompt = tok("q:")["input_ids"]
    seqs = []
    for completion, adv in zip(completions, advantages, strict=True):
        s = Sequence.supervised(prompt, tok(completion)["input_ids"])
        s.advantages = np.where(s.loss_mask, adv, 0.0).astype(np.float32)
        s.token_versions = np.where(s.loss_mask, learner.version, -1).astype(np.int32)
        seqs += [s] * 2
    batch, _ = pack(seqs, 4, 32)
    batch.sampler_logprobs = np.where(batch.loss_mask, learner.logprobs(batch) - 0.05, 0.0).astype(np.float32)
    return batch


def test_learner_restored_from_a_checkpoint_takes_exactly_the_same_next_step(tmp_path):
    tok, learner = _learner(kl_coef=0.1)  # with a KL penalty: the frozen reference model is part of the state
    learner.train_step(_batch(learner, tok, ["yes", "no"], [1.0, -1.0]))  # Adam moments and count are non-trivial
    path = begin_checkpoint(str(tmp_path / "ckpt"), 1)
    save_learner_state(learner, path, 1)
    assert is_complete(path)
    nxt = _batch(learner, tok, ["yes", "ok"], [1.0, -1.0])
    expected = learner.train_step(nxt)
    expected_weights = learner.weights()

    # Spoil everything in memory (the step changed the weights and optimizer state; the reference model and the
    # counters are changed here): all of it must come back from the checkpoint. The same learner is reused so that
    # its compiled step is too.
    learner.reference_model = jax.tree_util.tree_map(lambda x: x * 0.5, learner.reference_model)
    learner.version = learner.optimizer_steps = 7
    load_learner_state(learner, path)
    assert learner.version == 1 and learner.optimizer_steps == 1
    got = learner.train_step(nxt)
    assert learner.version == 2
    assert got["learner/loss"] == expected["learner/loss"]
    assert got["learner/grad_norm"] == expected["learner/grad_norm"]
    for a, b in zip(learner.weights(), expected_weights, strict=True):
        np.testing.assert_array_equal(a, b)


# ---- replay buffers and batcher ------------------------------------------------------------------------------
def _group(env, rng, version, n=4, problem="p"):
    rollouts = []
    for _ in range(n):
        gen = int(rng.integers(2, 6))
        turns = [
            Turn(role="user", message="q", token_ids=[int(x) for x in rng.integers(1, 50, size=3)]),
            Turn(
                role="assistant",
                message="a",
                token_ids=[int(x) for x in rng.integers(1, 50, size=gen)],
                sampler_logprobs=[float(x) for x in -rng.random(gen)],
                reward=float(rng.integers(0, 2)),
                inference_metadata=InferenceMetadata(server="s", version_start=version, version_end=version),
            ),
        ]
        rollouts.append(Rollout(environment=env, problem_id=problem, turns=turns))
    return RolloutGroup(environment=env, problem_id=problem, rollouts=rollouts)


def _buffers(max_reuse=2, estimator="reinforce"):
    cfg = ReplayConfig(max_age=3, max_reuse=max_reuse, advantage_estimator=estimator)
    return {n: ReplayBuffer(n, cfg, vocab_size=64, max_tokens=16, too_long="truncate") for n in ("a", "b")}


def test_replay_state_round_trip_gives_the_same_batches():
    rng = np.random.default_rng(0)
    bufs = _buffers()
    bcfg = BatcherConfig(total_token_budget=64, max_seq_len=16)
    batcher = Batcher(bcfg, bufs, {"a": 0.5, "b": 0.5})
    groups = [(n, _group(n, rng, v)) for v in range(3) for n in ("a", "b") for _ in range(3)]
    long = _group("a", rng, 2)
    long.rollouts[0].turns[1].token_ids += [7] * 20
    long.rollouts[0].turns[1].sampler_logprobs += [-0.1] * 20
    groups.append(("a", long))
    for n, g in groups:
        bufs[n].admit(g)
    assert bufs["a"].truncated_too_long == 1
    batcher.try_make_batch(2)
    state = json.loads(json.dumps({"buffers": {n: b.state_dict() for n, b in bufs.items()}}))

    later = [(n, _group(n, rng, 3)) for n in ("a", "b") for _ in range(2)]
    reference = []
    for n, g in later:
        bufs[n].admit(RolloutGroup.from_dict(g.to_dict()))
    for step in (3, 4, 5):
        made = batcher.try_make_batch(step)
        reference.append(made)
    assert sum(isinstance(r, FormedBatch) for r in reference) >= 2, "the comparison needs batches"

    bufs2 = _buffers()
    batcher2 = Batcher(bcfg, bufs2, {"a": 0.5, "b": 0.5})
    for n, b in bufs2.items():
        b.load_state_dict(state["buffers"][n])
    assert bufs2["a"].advantages.baseline == pytest.approx(state["buffers"]["a"]["reinforce_baseline"])
    for n, g in later:
        bufs2[n].admit(RolloutGroup.from_dict(g.to_dict()))
    for step, ref in zip((3, 4, 5), reference, strict=True):
        made = batcher2.try_make_batch(step)
        assert type(made) is type(ref)
        if not isinstance(ref, FormedBatch):
            continue
        for k, v in vars(ref.batch).items():
            np.testing.assert_array_equal(getattr(made.batch, k), v, err_msg=k)
        assert made.metrics == ref.metrics and made.usage == ref.usage
    assert bufs2["a"].truncated_too_long == bufs["a"].truncated_too_long
    assert {n: len(b) for n, b in bufs2.items()} == {n: len(b) for n, b in bufs.items()}


def test_groups_from_a_policy_version_newer_than_the_learner_are_dropped_and_counted():
    rng = np.random.default_rng(1)
    buf = ReplayBuffer("a", ReplayConfig(), vocab_size=64)
    assert buf.admit(_group("a", rng, 5), max_version=5).accepted
    assert not buf.admit(_group("a", rng, 6), max_version=5).accepted
    assert len(buf) == 4
    assert buf.metrics(5)["replays/a/rejected/future_version"] == 1


# ---- checkpoint directories ----------------------------------------------------------------------------------
def test_incomplete_checkpoint_is_never_loaded_and_is_pruned(tmp_path):
    root = str(tmp_path / "checkpoints")
    _, learner = _learner()
    for step in (1, 2, 3):
        path = begin_checkpoint(root, step)
        write_json(path, "run_state.json", {"step": step})
        save_learner_state(learner, path, step)
    # a writer that died during step 4's checkpoint: all its files but the completion marker
    _, other = _learner(seed=5)
    dead = begin_checkpoint(root, 4)
    write_json(dead, "run_state.json", {"step": 4})
    save_learner_state(other, dead, 4)
    os.remove(os.path.join(dead, MARKER_FILE))
    assert not is_complete(dead)

    latest = latest_checkpoint(root)
    assert latest == step_path(root, 3)
    _, fresh = _learner(seed=2)
    load_learner_state(fresh, latest)
    for a, b in zip(fresh.weights(), learner.weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FileNotFoundError):
        load_learner_state(fresh, dead)

    deleted = prune_checkpoints(root, keep=2)
    assert sorted(deleted) == sorted([step_path(root, 1), dead])
    assert sorted(os.listdir(root)) == ["step-2", "step-3"]
    assert latest_checkpoint(str(tmp_path / "nothing")) is None


def test_metrics_log_is_appended_on_resume_and_later_rows_supersede_lost_steps(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    t = JsonlTracker(path)
    for s in range(1, 6):
        t.log({"loss": float(s)}, step=s)
    t.finish()
    with open(path, "a") as f:
        f.write('{"step": 6, "lo')  # the process died mid-line
    t = JsonlTracker(path, resume_step=3, resume_path="ckpt/step-3")
    assert [r["step"] for r in t.history] == [1, 2, 3]
    for s in range(4, 7):
        t.log({"loss": 10.0 * s}, step=s)
    t.finish()
    raw = [json.loads(line) for line in open(path)]
    assert [r.get("step") for r in raw if "step" in r] == [1, 2, 3, 4, 5, 4, 5, 6], "nothing is truncated"
    assert raw[5] == {"resume": {"step": 3, "checkpoint": "ckpt/step-3", "time": raw[5]["resume"]["time"]}}
    rows = read_metrics(path)
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]


# ---- a real run killed with SIGKILL and resumed --------------------------------------------------------------
_SLOTS = (DEFAULT_ROOT, PRIVATE_PREFIX)


def _start(config: Path, log: Path, mark: tuple[str, str] | None = None) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "marin_rl.run", "--config", str(config)],
            cwd=ROOT,
            env=dict(os.environ, **dict([mark])) if mark else None,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own session: Ray's processes can be found (and reaped) by session id
        )


def _reap_session(sid: int) -> None:
    """SIGKILL whatever is left of the session `sid` that a test started (Ray's agents outlive a killed driver)."""
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, s = (int(x) for x in line.split())
        if s == sid and pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _stop_all(procs: list[subprocess.Popen]) -> None:
    """Kill what still runs of the runs `procs` a test started, and whatever is left of their sessions."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
        _reap_session(p.pid)


def _wait(proc: subprocess.Popen, log: Path, timeout: float, expect_rc: int = 0) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        _reap_session(proc.pid)
    assert rc == expect_rc, f"run ended with rc={rc}, expected {expect_rc}:\n" + log.read_text()[-6000:]


def _progress(out: Path) -> tuple[list[int], int]:
    """(steps of the complete checkpoints, last step in the effective metrics log) of a run in progress."""
    saved = [int(p.parent.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*/metadata.json")]
    metrics = out / "metrics.jsonl"
    logged = [r["step"] for r in read_metrics(str(metrics))] if metrics.exists() else []
    return saved, max(logged, default=-1)


def _markers(out: Path) -> list[dict]:
    """The resume lines of a run's metrics log."""
    rows = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [r["resume"] for r in rows if "resume" in r]


def _signal_when(proc: subprocess.Popen, log: Path, out: Path, sig: int, ready, timeout: float = 400):
    """Send `sig` to the run as soon as `ready(saved, last_logged)` holds; returns (saved, last_logged) then."""
    deadline = time.time() + timeout
    while True:
        assert proc.poll() is None, "the run ended before it could be interrupted:\n" + log.read_text()[-4000:]
        assert time.time() < deadline, "the run made no progress in time:\n" + log.read_text()[-4000:]
        saved, last = _progress(out)
        if ready(saved, last):
            os.kill(proc.pid, sig)
            return saved, last
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.exclusive  # the clean-up's wall-clock bound, and no dead run's weight slot anywhere
def test_run_killed_with_sigkill_and_resumed_matches_an_uninterrupted_run(tmp_path):
    """Deterministic runs (orchestrator.deterministic): one uninterrupted; one SIGKILLed after a checkpoint and a
    later step, resumed, stopped with SIGTERM (clean stop: checkpoint at that step), resumed again to the end."""
    steps, every = 12, 3
    ref_cfg = deterministic_config(tmp_path / "reference", steps, every)
    cfg = deterministic_config(tmp_path / "killed", steps, every)
    ref_log, log = tmp_path / "reference.log", tmp_path / "killed.log"
    out = tmp_path / "killed"
    ckpts = out / "checkpoints"
    reference = _start(ref_cfg, ref_log)  # the uninterrupted run, alongside the one to be killed
    procs = [reference]
    try:
        mark = new_mark()
        proc = _start(cfg, log, mark)
        procs.append(proc)
        # 1. SIGKILL once a checkpoint is complete and a later step was trained (so work after it is lost); within
        # 10 s nothing of that run is left: no process (Ray's, the actors', the watchdog's) and no weight slot
        saved, killed_after = _signal_when(proc, log, out, signal.SIGKILL, lambda s, last: s and last > max(s))
        proc.wait()
        seconds = wait_until(lambda: not marked_processes(*mark) and not dead_weight_slot_dirs(*_SLOTS), 10)
        left, slots = describe(marked_processes(*mark)), dead_weight_slot_dirs(*_SLOTS)
        _reap_session(proc.pid)
        assert left == [] and slots == [], f"left 10 s after the driver's SIGKILL: processes {left}, slots {slots}"
        print(f"the killed run's processes and weight slots were gone {seconds:.1f}s after the driver's SIGKILL")
        first_resume = max(saved)
        assert 1 <= first_resume < killed_after < steps
        # 2. resume; SIGTERM once it trained a step: it finishes that step, checkpoints it and exits with 130
        proc = _start(cfg, log)
        procs.append(proc)
        _, last = _signal_when(
            proc, log, out, signal.SIGTERM, lambda s, last: len(_markers(out)) == 1 and last > first_resume
        )
        _wait(proc, log, 300, expect_rc=130)
        saved, stopped_at = _progress(out)
        assert stopped_at == max(saved) and last <= stopped_at < steps, "a clean stop checkpoints its last step"
        # 3. resume again, to the end
        proc = _start(cfg, log)
        procs.append(proc)
        _wait(proc, log, 400)
        _wait(reference, ref_log, 400)
    finally:
        _stop_all(procs)

    text = log.read_text()
    assert f"resumed from step {first_resume} at {ckpts / f'step-{first_resume}'}" in text
    assert f"resumed from step {stopped_at} at {ckpts / f'step-{stopped_at}'}" in text
    assert "stopping after the current learner step" in text
    assert warm_starts(text) == 1, "the warm start runs once, before the first checkpoint"

    # every step is trained exactly once: the effective log has each step once, and each resumed process logged
    # exactly the steps after its checkpoint, in order, after its resume marker
    rows = read_metrics(str(out / "metrics.jsonl"))
    ref_rows = read_metrics(str(tmp_path / "reference" / "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(steps + 1)) == [r["step"] for r in ref_rows]
    raw = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    markers = [i for i, r in enumerate(raw) if "resume" in r]
    assert [raw[i]["resume"]["step"] for i in markers] == [first_resume, stopped_at]
    logged_by = [
        [r["step"] for r in raw[a:b] if "step" in r] for a, b in zip([0, *markers], [*markers, len(raw)], strict=True)
    ]
    assert logged_by == [
        list(range(killed_after + 1)),
        list(range(first_resume + 1, stopped_at + 1)),
        list(range(stopped_at + 1, steps + 1)),
    ]
    for r in rows[1:]:
        assert r["learner/optimizer_steps"] == r["step"]

    # the same batches, losses and final arrays as the uninterrupted run
    for r, ref in zip(rows[1:], ref_rows[1:], strict=True):
        for key in ("batches/rollouts", "batches/tokens", "batches/trained_tokens", "batches/addition/reward/mean"):
            assert r[key] == ref[key], (r["step"], key)
        for key in ("learner/loss", "learner/grad_norm", "learner/entropy", "learner/kl_sampler"):
            np.testing.assert_allclose(r[key], ref[key], rtol=1e-5, atol=1e-7, err_msg=f"step {r['step']} {key}")
    assert any(abs(r["learner/loss"]) > 1e-4 for r in ref_rows[1:]), "the comparison needs a learning signal"
    final = final_learner_arrays(cfg, out, steps)
    ref_final = final_learner_arrays(ref_cfg, tmp_path / "reference", steps)
    for a, b in zip(final, ref_final, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and summary["resumed_from"] == str(ckpts / f"step-{stopped_at}")
    ref_summary = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert summary["generated_tokens"] == ref_summary["generated_tokens"], "nothing generated twice or lost"
    # the rollout store's surviving timeline holds exactly the accepted groups, the reference run's problems; the
    # groups of the steps lost to the SIGKILL stay on disk, superseded
    stored, surviving, problems = stored_timeline(out)
    ref_stored, ref_surviving, ref_problems = stored_timeline(tmp_path / "reference")
    assert ref_stored == ref_surviving and surviving == ref_surviving and problems == ref_problems
    print(f"rollout store: {stored} groups stored, {surviving} on the surviving timeline")
    assert stored > surviving, (stored, surviving)


@pytest.mark.slow
def test_ppo_run_killed_with_sigkill_and_resumed_matches_an_uninterrupted_run(tmp_path):
    """With a critic (PPO and GAE): a deterministic run SIGKILLed after a checkpoint and a later step, resumed to the
    end, trains the same steps as an uninterrupted one: policy and critic metrics, and final policy and critic
    arrays with their optimizer states."""
    steps, every = 8, 3
    ref_cfg = deterministic_config(tmp_path / "reference", steps, every, ppo=True)
    cfg = deterministic_config(tmp_path / "killed", steps, every, ppo=True)
    ref_log, log, out = tmp_path / "reference.log", tmp_path / "killed.log", tmp_path / "killed"
    reference = _start(ref_cfg, ref_log)
    procs = [reference]
    try:
        proc = _start(cfg, log)
        procs.append(proc)
        saved, killed_after = _signal_when(proc, log, out, signal.SIGKILL, lambda s, last: s and last > max(s))
        proc.wait()
        _reap_session(proc.pid)
        proc = _start(cfg, log)
        procs.append(proc)
        _wait(proc, log, 400)
        _wait(reference, ref_log, 400)
    finally:
        _stop_all(procs)
    assert f"resumed from step {max(saved)}" in log.read_text() and max(saved) < killed_after < steps
    rows = read_metrics(str(out / "metrics.jsonl"))
    ref_rows = read_metrics(str(tmp_path / "reference" / "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(steps + 1)) == [r["step"] for r in ref_rows]
    keys = (
        "learner/loss",
        "learner/grad_norm",
        "learner/critic/value_loss",
        "learner/critic/grad_norm",
        "learner/critic/return_mean",
        "learner/critic/explained_variance",
    )
    for r, ref in zip(rows[1:], ref_rows[1:], strict=True):
        for key in keys:
            np.testing.assert_allclose(r[key], ref[key], rtol=1e-5, atol=1e-7, err_msg=f"step {r['step']} {key}")
    assert any(r["learner/critic/value_loss"] > 1e-4 for r in ref_rows[1:]), "the critic needs something to learn"
    final = final_learner_arrays(cfg, out, steps)
    ref_final = final_learner_arrays(ref_cfg, tmp_path / "reference", steps)
    for a, b in zip(final, ref_final, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
