"""The public API (`marin_rl.api`): the loss registry, a user loss against a NumPy reference, weighted gradient
accumulation, the inference engine's calls, and `prepare_batch` under the staleness bound with a slow learner."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from marin_rl.api import EngineConfig, InferenceEngine, TrainEngine, get_loss, known_losses, register_loss
from marin_rl.broadcast.base import BroadcastConfig, WeightSubscriber, make_transport
from marin_rl.config import make_environment, parse_config
from marin_rl.envs.base import SamplingParams
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.learner.config import LossConfig
from marin_rl.model.build import build_model
from marin_rl.replay.batcher import BatcherConfig
from marin_rl.replay.buffer import ReplayConfig
from marin_rl.replay.packing import Sequence, pack

ROOT = Path(__file__).resolve().parents[1]


def _user_module(name: str):
    """Import an example from experiments/ as user code does (a file outside the package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _config(*overrides: str):
    return parse_config(
        ["--config", str(ROOT / "experiments/quickstart.yaml"), "--broadcast.transport", "in_process", *overrides]
    )


# ---- the loss registry --------------------------------------------------------------------------------------
def test_builtin_objectives_are_registered_losses_and_unknown_names_fail():
    assert {"decoupled", "ppo"} <= set(known_losses())
    assert get_loss("ppo").uses_proximal is False and get_loss("decoupled").uses_proximal is True
    assert get_loss("decoupled").takes_config and get_loss("decoupled").takes_normalizers
    with pytest.raises(ValueError, match="unknown loss 'nope'"):
        get_loss("nope")
    with pytest.raises(ValueError, match="loss.objective"):
        LossConfig(objective="nope")
    with pytest.raises(ValueError, match="cannot be imported"):
        get_loss("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="without ':'"):
        register_loss("a:b")


def test_a_loss_registered_in_user_code_is_found_by_name_and_by_config():
    module = _user_module("custom_loss")
    spec = get_loss("sequence_clip")
    assert spec.fn is module.sequence_clip and not spec.takes_config
    assert LossConfig(objective="sequence_clip").uses_proximal is False
    # 'module:function' imports the module (here: the file already imported) and finds the registered function
    assert get_loss("custom_loss:sequence_clip") is spec


def _fixed_batch(tok, rng):
    """Eight rollouts (prompt + completion of 2-6 tokens) with per-rollout advantages, packed into 4 rows."""
    seqs = []
    for i in range(8):
        prompt = rng.integers(3, 40, size=int(rng.integers(3, 7))).tolist()
        completion = rng.integers(3, 40, size=int(rng.integers(2, 7))).tolist()
        s = Sequence.supervised(prompt, completion)
        s.advantages = np.where(s.loss_mask, [-1.5, 1.0, 0.5, -0.25][i % 4], 0.0).astype(np.float32)
        s.token_versions = np.where(s.loss_mask, 0, -1).astype(np.int32)
        seqs.append(s)
    batch, placed = pack(seqs, 4, 32)
    assert len(placed) == 8
    return batch


def _numpy_sequence_clip(lp, batch, eps_low, eps_high):
    """The sequence-level clipped objective from its formula, sequence by sequence."""
    terms = []
    for row in range(batch.num_rows):
        for seg in set(batch.segment_ids[row][batch.segment_ids[row] >= 0].tolist()):
            m = (batch.segment_ids[row] == seg) & batch.loss_mask[row]
            if not m.any():
                continue
            s = np.exp(np.mean(lp[row][m].astype(np.float64) - batch.sampler_logprobs[row][m]))
            a = float(batch.advantages[row][m][0])
            terms.append(min(s * a, np.clip(s, 1 - eps_low, 1 + eps_high) * a))
    return -float(np.mean(terms)), len(terms)


def test_user_sequence_loss_equals_numpy_reference_and_trains():
    module = _user_module("custom_loss")
    trainer = TrainEngine(_config("--learner.optimizer.learning_rate", "3e-3"))
    batch = _fixed_batch(trainer.tokenizer, np.random.default_rng(0))
    lp = trainer.forward(batch)
    # sampler logprobs off the learner's by up to ±0.3 per token: sequence ratios inside and outside the clip range
    noise = np.random.default_rng(1).uniform(-0.3, 0.3, size=lp.shape).astype(np.float32)
    batch.sampler_logprobs = np.where(batch.loss_mask, lp + noise, 0.0).astype(np.float32)
    expected, num_seqs = _numpy_sequence_clip(lp, batch, module.EPS_LOW, module.EPS_HIGH)
    assert num_seqs == 8
    metrics = trainer.train_batch(batch, loss_fn="sequence_clip")
    assert abs(metrics["learner/loss"] - expected) < 1e-5, (metrics["learner/loss"], expected)
    assert 0 < metrics["learner/clip_frac"] < 1  # some sequences clipped, some not: both branches are exercised
    assert trainer.version == 1
    losses = [metrics["learner/loss"]]
    for _ in range(10):
        losses.append(trainer.train_batch(batch, loss_fn=module.sequence_clip)["learner/loss"])
    after, _ = _numpy_sequence_clip(trainer.forward(batch), batch, module.EPS_LOW, module.EPS_HIGH)
    assert after < expected - 0.05, (expected, after, losses)  # the objective improved on the batch


def _token_mean_loss(logprobs, entropy, batch):
    mask = batch.loss_mask.array
    per_token = -batch.advantages.array * logprobs.array
    return jnp.sum(jnp.where(mask, per_token, 0.0)) / jnp.maximum(jnp.sum(mask), 1), {}


def test_custom_loss_accumulates_microbatches_by_their_weights():
    """A token-mean loss accumulated over 2 chunks weighted by their tokens (the default loss_weight_fn) takes
    the same step as the whole batch at once; weighting the chunks equally takes a different one."""
    params, metrics = [], []
    for micro, weight_fn in ((1, None), (2, None), (2, lambda chunk: jnp.float32(1.0))):
        trainer = TrainEngine(_config("--learner.microbatches", str(micro)))
        learner = trainer.learner  # plain SGD with step 1: a step moves the parameters by minus the gradient
        learner.optimizer = optax.sgd(1.0)
        learner.opt_state = learner.optimizer.init(eqx.filter(learner.model, eqx.is_inexact_array))
        batch = _fixed_batch(trainer.tokenizer, np.random.default_rng(0))
        batch.sampler_logprobs = np.where(batch.loss_mask, trainer.forward(batch), 0.0).astype(np.float32)
        metrics.append(trainer.train_batch(batch, loss_fn=_token_mean_loss, loss_weight_fn=weight_fn))
        params.append(learner.weights())
    # the two halves of the batch (rows 0-1 and 2-3) hold different numbers of sampled tokens
    assert np.count_nonzero(batch.loss_mask[:2]) != np.count_nonzero(batch.loss_mask[2:])
    whole, weighted, equal = params
    for a, b in zip(whole, weighted, strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5)
    np.testing.assert_allclose(metrics[1]["learner/loss"], metrics[0]["learner/loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics[1]["learner/grad_norm"], metrics[0]["learner/grad_norm"], rtol=1e-4)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(whole, equal, strict=True)) > 1e-4


# ---- the inference engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines():
    cfg = _config("--learner.warm_start.steps", "0", "--inference.levanter.segment_tokens", "2")
    trainer = TrainEngine(cfg)
    env = make_environment(cfg.envs[0], trainer.tokenizer, seed=0)
    yield cfg, trainer, env
    trainer.close()


def _engine_config(cfg, max_staleness: int, group_size: int = 4) -> EngineConfig:
    """Groups of `group_size`, batches of 512 tokens in rows of 64, every trained token at most `max_staleness`
    versions behind (`replay.max_age`, the hard bound)."""
    return EngineConfig(
        group_size=group_size,
        sampling=cfg.envs[0].sampling,
        max_staleness=max_staleness,
        replay=ReplayConfig(min_group_size=2, max_age=max_staleness),
        batcher=BatcherConfig(total_token_budget=512, max_seq_len=64),
    )


def test_engine_calls_generate_prepare_batch_pause_and_track_versions(engines):
    cfg, trainer, env = engines
    with InferenceEngine.local(cfg, _engine_config(cfg, 0), tokenizer=trainer.tokenizer) as inference:
        assert inference.version == -1
        trainer.update_weights(inference)
        assert inference.version == trainer.version == 0
        assert inference.stats()["servers"][0]["version"] == 0
        prompt = env.encode_prompt(env.train_problems()[0])
        samples = asyncio.run(inference.agenerate(prompt, n=3, max_tokens=4))
        assert len(samples) == 3 and all(s.token_versions == [0] * len(s.token_ids) for s in samples)
        inference.pause()
        with pytest.raises(TimeoutError, match="no batch within"):
            inference.prepare_batch(env, timeout=1.0)
        assert inference.counters["started"] == 0  # paused: no group starts
        inference.resume()
        formed = inference.prepare_batch(env, timeout=120)
        assert formed.num_rollouts > 0 and formed.metrics["batches/rollouts"] == formed.num_rollouts
        assert {item.rollout.problem_id for item, _ in formed.placed} <= {p.id for p in env.train_problems()}
        assert inference.counters["accepted"] >= formed.num_rollouts // 4
        metrics = trainer.train_batch(formed)  # what prepare_batch formed trains as is
        assert np.isfinite(metrics["learner/loss"]) and trainer.version == 1
        groups = inference.rollout_batch(env.eval_problems()[:3], env, group_size=2)
        assert [g.problem_id for g in groups] == [p.id for p in env.eval_problems()[:3]]
        # evaluate: the run's held-out metrics. At temperature 0 every sample is the greedy completion, so the
        # metrics follow from greedy groups sampled through rollout_batch and scored here.
        problems = env.eval_problems()[:6]
        greedy = SamplingParams(temperature=0.0, max_tokens=cfg.envs[0].sampling.max_tokens)
        reference = np.array(
            [g.rollouts[0].reward for g in inference.rollout_batch(problems, env, group_size=1, sampling=greedy)]
        )
        metrics = inference.evaluate(env, problems, samples_per_problem=3, sampling=greedy)
        assert metrics == {
            "reward": pytest.approx(reference.mean()),
            "pass@1": pytest.approx((reference > 0).mean()),
            "pass@3": pytest.approx((reference > 0).mean()),
            "greedy_reward": pytest.approx(reference.mean()),
            "problems": 6,
            "rewards/correct": pytest.approx(reference.mean()),  # the named reward's mean (here it is the reward)
        }
        seeded = [inference.evaluate(env, problems, samples_per_problem=4, seed=11) for _ in range(2)]
        assert seeded[0] == seeded[1]  # seeded samples are a function of the seed and the weights
        assert 0 <= seeded[0]["pass@1"] <= seeded[0]["pass@4"] <= 1
        with pytest.raises(ValueError, match="no held-out problems"):
            inference.evaluate(env, [])
        # ReMax: a group sampled with its greedy episode carries that episode's reward as its baseline
        group = inference._loop.call(
            inference.worker.run_group(env, problems[0], 2, cfg.envs[0].sampling, greedy_baseline=True)
        )
        assert len(group.rollouts) == 2 and group.baseline_reward == reference[0]


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_prepare_batch_respects_the_staleness_bound_under_a_slow_learner(engines, max_staleness):
    """The learner sleeps 1 s per step while groups keep being generated in the background; every trained token
    lags the learner by at most max_staleness versions, and with max_staleness 1 generation does run ahead."""
    cfg, trainer, env = engines
    engine = _engine_config(cfg, max_staleness)
    lags, ahead, in_flight, room = [], [], [], []
    with InferenceEngine.local(cfg, engine, tokenizer=trainer.tokenizer) as inference:
        trainer.update_weights(inference)
        for _ in range(6):
            formed = inference.prepare_batch(env, timeout=120)
            time.sleep(1.0)  # a slow learner: generation goes on meanwhile, as far as the gate lets it
            stats = inference.stats()  # rollouts of later batches already started (finished or in flight)
            in_flight.append(stats["in_flight_rollouts"])
            ahead.append(stats["in_flight_rollouts"] + stats["buffered_rollouts"])
            room.append(max_staleness * stats["rollouts_per_batch"] + engine.group_size)
            batch = formed.batch
            lags.append(trainer.version - batch.token_versions[batch.loss_mask])
            trainer.train_batch(formed)
            trainer.update_weights(inference)
    lag = np.concatenate(lags)
    assert lag.size > 100 and lag.min() >= 0
    assert lag.max() <= max_staleness, np.bincount(lag)
    # the gate's room while a batch trains: max_staleness more batches (plus one group under the starvation rule)
    assert all(a <= r for a, r in zip(ahead, room, strict=True)), (ahead, room)
    if max_staleness == 0:
        assert max(in_flight) == 0, in_flight  # nothing is sampled until the new weights are served
    else:
        assert max(in_flight) > 0 and lag.max() == 1, (in_flight, np.bincount(lag))  # generation runs ahead


def test_remote_engine_updates_and_pauses_servers_through_their_control_routes(engines, tmp_path):
    """A server started elsewhere (here: in this process, behind HTTP only) with a transport that reaches across
    processes: the engine applies updates, pauses and resumes it through the authenticated control routes."""
    cfg, trainer, env = engines
    broadcast = BroadcastConfig(transport="fsspec", path=str(tmp_path / "weights"))
    server = LevanterInferenceServer(build_model(cfg.model, len(trainer.tokenizer)), trainer.tokenizer, cfg.inference)
    server_transport, publisher = make_transport(broadcast), make_transport(broadcast)
    server.control_secret = "s3cret"
    server.weights_source = WeightSubscriber(server_transport, server.apply_weights).poll
    address = server.start()
    try:
        engine = EngineConfig(group_size=2, sampling=cfg.envs[0].sampling)
        with InferenceEngine.remote([address], engine, control_secret="s3cret") as inference:
            trainer.train_batch(_fixed_batch(trainer.tokenizer, np.random.default_rng(0)), loss_fn=_token_mean_loss)
            inference.apply_update(publisher.publish(trainer.version, trainer.learner.model))
            assert inference.version == server.version == trainer.version >= 1
            inference.pause()
            assert server.stats()["paused"] and inference.paused
            inference.resume()
            assert not server.stats()["paused"]
            groups = inference.rollout_batch(env.eval_problems()[:2], env)
            versions = {v for g in groups for r in g.rollouts for v in r.turns[1].inference_metadata.token_versions}
            assert versions == {trainer.version}
        with InferenceEngine.remote([address], engine, control_secret="wrong") as wrong:
            with pytest.raises(RuntimeError, match="403"):
                wrong.pause()
    finally:
        server.stop()
        server_transport.close()
        publisher.close()


def test_train_engine_save_and_load_round_trip(engines, tmp_path):
    cfg, trainer, env = engines
    batch = _fixed_batch(trainer.tokenizer, np.random.default_rng(0))
    batch.sampler_logprobs = np.where(batch.loss_mask, trainer.forward(batch), 0.0).astype(np.float32)
    path = trainer.save(str(tmp_path / "ckpt"))
    version, before = trainer.version, trainer.forward(batch)
    trainer.train_batch(batch, loss_fn=_token_mean_loss)
    assert np.abs(trainer.forward(batch) - before).max() > 1e-4
    assert trainer.load(path) == version
    np.testing.assert_array_equal(trainer.forward(batch), before)
    with pytest.raises(FileNotFoundError):
        trainer.load(str(tmp_path / "missing"))


# ---- the examples --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_custom_loop_example_learns():
    module = _user_module("custom_loop")
    result = module.main(steps=200)
    assert result["reward_end"] - result["reward_start"] >= 0.3, result
