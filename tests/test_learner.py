"""The learner: versions, the on-policy ratio, and that its updates move probability the right way."""

from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import optax
import pytest

from marin_rl.bounds import deferred_checks
from marin_rl.learner.config import LearnerConfig, LossConfig, WarmStartConfig
from marin_rl.learner.learner import Learner, NonFiniteTrainingError
from marin_rl.learner.optimizer import OptimizerConfig
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.model.logprobs import packed_attention_mask
from marin_rl.replay.packing import Sequence, pack
from marin_rl.tokenizer import build_char_tokenizer


def _learner(lr=1e-3, warm_steps=0, temperature=1.0, loss=None, **learner_kwargs):
    tok = build_char_tokenizer()
    cfg = LearnerConfig(
        optimizer=OptimizerConfig(learning_rate=lr),
        warm_start=WarmStartConfig(steps=warm_steps, batch_rows=8),
        loss=loss or LossConfig(),
        **learner_kwargs,
    )
    return tok, Learner(ModelConfig(architecture=tiny_llama()), cfg, len(tok), temperature=temperature)


def _rl_batch(learner, tok, good: str, bad: str):
    """On-policy rollouts of 'q:' -> good (advantage +1) and -> bad (advantage -1), sampler logprobs = learner's."""
    prompt = tok("q:")["input_ids"]
    seqs = []
    for completion, adv in ((good, 1.0), (bad, -1.0)):
        ids = tok(completion)["input_ids"]
        s = Sequence.supervised(prompt, ids)
        s.advantages = np.where(s.loss_mask, adv, 0.0).astype(np.float32)
        s.token_versions = np.where(s.loss_mask, learner.version, -1).astype(np.int32)
        seqs += [s] * 4
    batch, _ = pack(seqs, 4, 32)
    batch.sampler_logprobs = np.where(batch.loss_mask, learner.logprobs(batch), 0.0).astype(np.float32)
    return batch


def _seq_logprob(learner, batch, row_mask):
    lp = learner.logprobs(batch)
    return float((lp * row_mask).sum())


def test_train_step_increments_version_and_ratio_is_exactly_one_on_policy():
    tok, learner = _learner()
    batch = _rl_batch(learner, tok, "yes", "no")
    metrics = learner.train_step(batch)
    assert learner.version == 1
    assert metrics["learner/ratio/mean"] == 1.0
    assert metrics["learner/ratio/max"] == 1.0 and metrics["learner/ratio/min"] == 1.0
    assert metrics["learner/logprob_diff_sampler/max_abs"] < 1e-5
    assert metrics["learner/trained_tokens"] == int(batch.loss_mask.sum())


def test_a_step_replaces_the_learners_train_state_and_a_checkpoint_stores_it_by_field_name():
    """The learner's policy, optimizer state and counters are one `TrainState`; a train step replaces it (the old
    state is untouched), and `state()` (what a checkpoint writes) is it with int32 counters, whose array paths are
    the field names (those of the checkpoints written before the state was one module)."""
    from levanter.utils.jax_utils import leaf_key_paths

    from marin_rl.learner.train_state import TrainState

    tok, learner = _learner(lr=3e-3)
    before = learner.train_state
    first = [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(before.model, eqx.is_array))]
    learner.train_step(_rl_batch(learner, tok, "yes", "no"))
    after = learner.train_state
    assert after is not before and (after.version, after.optimizer_steps) == (1, 1)
    assert (before.version, before.optimizer_steps) == (0, 0)
    assert all(
        np.array_equal(a, np.asarray(b))
        for a, b in zip(first, jax.tree_util.tree_leaves(eqx.filter(before.model, eqx.is_array)), strict=True)
    )
    assert learner.model is after.model and learner.opt_state is after.opt_state
    state = learner.state()
    assert isinstance(state, TrainState) and state.model is after.model
    assert state.version.dtype == np.int32 and int(state.version) == 1 and int(state.optimizer_steps) == 1
    assert state.reference_model is None and state.critic is None and state.critic_steps is None
    paths = jax.tree_util.tree_leaves(leaf_key_paths(state, is_leaf=lambda x: isinstance(x, hax.NamedArray)))
    assert {p.split(".")[0] for p in paths} == {"model", "opt_state", "version", "optimizer_steps"}


def test_policy_gradient_raises_good_and_lowers_bad_completions():
    tok, learner = _learner(lr=3e-3)
    batch = _rl_batch(learner, tok, "yes", "no")
    good = batch.loss_mask & (batch.advantages > 0)
    bad = batch.loss_mask & (batch.advantages < 0)
    g0, b0 = _seq_logprob(learner, batch, good), _seq_logprob(learner, batch, bad)
    for _ in range(5):
        learner.train_step(_rl_batch(learner, tok, "yes", "no"))
    g1, b1 = _seq_logprob(learner, batch, good), _seq_logprob(learner, batch, bad)
    assert g1 > g0 + 1.0
    assert b1 < b0 - 1.0


def test_warm_start_reduces_supervised_loss():
    tok = build_char_tokenizer()
    cfg = LearnerConfig(warm_start=WarmStartConfig(steps=60, batch_rows=8, learning_rate=3e-3))
    learner = Learner(ModelConfig(architecture=tiny_llama()), cfg, len(tok))
    examples = [(tok(f"{a}+{a}=")["input_ids"], tok(str(2 * a))["input_ids"] + [tok.eos_token_id]) for a in range(50)]
    result = learner.warm_start(examples, 32)
    losses = result["losses"]
    assert len(losses) == 60
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:5])
    assert learner.version == 0, "the warm start does not create policy versions"


def _arrays(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))]


def test_a_warm_start_is_reused_bit_identical_from_its_cache_and_only_when_identical(tmp_path, caplog):
    tok = build_char_tokenizer()
    examples = [(tok(f"{a}+{a}=")["input_ids"], tok(str(2 * a))["input_ids"] + [tok.eos_token_id]) for a in range(30)]

    def warm(examples=examples, **changes):
        ws = dict(steps=12, batch_rows=4, learning_rate=3e-3, cache_dir=str(tmp_path / "cache")) | changes
        learner = Learner(
            ModelConfig(architecture=tiny_llama()), LearnerConfig(warm_start=WarmStartConfig(**ws)), len(tok)
        )
        return learner, learner.warm_start(examples, 32, seed=0)

    entries = lambda: sorted((tmp_path / "cache").rglob("*.eqx"))  # noqa: E731
    trained, first = warm(cache_dir=None)  # no cache: trained
    assert "cached" not in first and entries() == []
    stored, second = warm()  # trained and stored
    assert "cached" not in second and len(entries()) == 1
    reused, third = warm()  # loaded
    assert third["cached"] == str(entries()[0]) and third["losses"] == first["losses"]
    for a, b, c in zip(_arrays(trained.model), _arrays(stored.model), _arrays(reused.model), strict=True):
        assert a.dtype == c.dtype and np.array_equal(a, b) and np.array_equal(a, c), "not bit-identical"
    untrained = Learner(ModelConfig(architecture=tiny_llama()), LearnerConfig(), len(tok))
    assert any(not np.array_equal(a, u) for a, u in zip(_arrays(reused.model), _arrays(untrained.model), strict=True))

    # anything the result depends on is a new entry: a demonstration, a setting, the seed of the initial weights
    changed = [(examples[0][0], examples[0][1][:-2] + examples[0][1][-1:]), *examples[1:]]
    assert "cached" not in warm(changed)[1]
    assert "cached" not in warm(learning_rate=2e-3)[1]
    assert len(entries()) == 3
    learner = Learner(
        ModelConfig(architecture=tiny_llama(), seed=1),
        LearnerConfig(warm_start=WarmStartConfig(steps=12, batch_rows=4, cache_dir=str(tmp_path / "cache"))),
        len(tok),
    )
    assert "cached" not in learner.warm_start(examples, 32, seed=0) and len(entries()) == 4

    # an unreadable entry is trained again (and rewritten); a cap below the model's size caches nothing
    Path(third["cached"]).write_bytes(b"not an entry")
    with caplog.at_level("WARNING"):
        retrained, again = warm()
    assert "cached" not in again and "could not read" in caplog.text
    assert warm()[1]["cached"] == third["cached"]
    assert all(np.array_equal(a, b) for a, b in zip(_arrays(trained.model), _arrays(retrained.model), strict=True))
    assert "cached" not in warm(cache_max_mb=0, steps=13)[1] and len(entries()) == 4


@pytest.mark.exclusive  # the interruption's wall-clock bound
def test_a_warm_start_in_progress_ends_after_its_current_step_when_interrupted():
    # the local backend's learner runs in a thread; a stopped run sets `interrupted` and waits for that thread
    import concurrent.futures
    import time

    tok = build_char_tokenizer()
    cfg = LearnerConfig(warm_start=WarmStartConfig(steps=1_000_000, batch_rows=4, cache_dir=None))
    learner = Learner(ModelConfig(architecture=tiny_llama()), cfg, len(tok))
    examples = [(tok(f"{a}+{a}=")["input_ids"], tok(str(2 * a))["input_ids"] + [tok.eos_token_id]) for a in range(30)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(learner.warm_start, examples, 32)
        time.sleep(3)
        assert not future.done()
        learner.interrupted.set()
        start = time.time()
        with pytest.raises(KeyboardInterrupt, match=r"warm start interrupted after \d+ of 1000000 steps"):
            future.result(timeout=30)
        assert time.time() - start < 5


def test_weights_round_trip_shapes():
    tok, learner = _learner()
    leaves = learner.weights()
    assert sum(x.size for x in leaves) == learner.num_params
    assert all(isinstance(x, np.ndarray) for x in leaves)


def _full_batch(learner, tok, noise=0.0, seed=0):
    """Four rows that all hold sampled tokens; sampler logprobs = learner's, optionally perturbed (a mismatch)."""
    rng = np.random.default_rng(seed)
    prompt = tok("q:")["input_ids"]
    seqs = []
    for i in range(8):
        s = Sequence.supervised(prompt, tok(["yes please", "no thanks"][i % 2])["input_ids"])
        s.advantages = np.where(s.loss_mask, rng.normal(), 0.0).astype(np.float32)
        s.token_versions = np.where(s.loss_mask, learner.version, -1).astype(np.int32)
        seqs.append(s)
    batch, _ = pack(seqs, 4, 24)
    assert batch.loss_mask.any(axis=1).all()
    lp = learner.logprobs(batch) + noise * rng.normal(size=batch.loss_mask.shape)
    batch.sampler_logprobs = np.where(batch.loss_mask, np.minimum(lp, 0.0), 0.0).astype(np.float32)
    return batch


def _use_sgd(learner):
    """Plain SGD with step 1: one step moves the parameters by exactly minus the gradient."""
    learner.optimizer = optax.sgd(1.0)
    learner.opt_state = learner.optimizer.init(eqx.filter(learner.model, eqx.is_inexact_array))


def test_logprobs_honour_the_sampling_temperature():
    tok, learner = _learner(temperature=0.7)
    batch = _rl_batch(learner, tok, "yes", "no")
    Batch, Pos = hax.Axis("batch", batch.num_rows), hax.Axis("position", batch.seq_len)
    ids = hax.named(batch.input_ids.astype(np.int32), (Batch, Pos))
    seg = hax.named(batch.segment_ids.astype(np.int32), (Batch, Pos))
    pos = hax.named(batch.position_ids.astype(np.int32), (Batch, Pos))
    logits = learner.model(ids, attn_mask=packed_attention_mask(seg), pos_ids=pos)
    logits = np.asarray(logits.rearrange((Batch, Pos, learner.model.Vocab)).array, np.float64) / 0.7
    log_softmax = logits - logits.max(-1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
    expected = np.zeros(batch.input_ids.shape)
    for b in range(batch.num_rows):
        for t in range(1, batch.seq_len):
            expected[b, t] = log_softmax[b, t - 1, batch.input_ids[b, t]]
    np.testing.assert_allclose(learner.logprobs(batch), expected, atol=2e-5)


def test_no_reference_model_without_kl_penalty():
    tok, learner = _learner(warm_steps=2)
    learner.warm_start([(tok("q:")["input_ids"], tok("yes")["input_ids"])] * 4, 32)
    assert learner.freeze_reference() is False
    metrics = learner.train_step(_rl_batch(learner, tok, "yes", "no"))
    assert learner.reference_model is None
    assert "learner/kl_reference" not in metrics


def test_kl_penalty_uses_a_frozen_copy_of_the_initial_policy():
    tok, learner = _learner(lr=3e-3, loss=LossConfig(kl_coef=0.1, kl_estimator="k3"))
    initial = learner.weights()
    metrics = learner.train_step(_full_batch(learner, tok))
    assert learner.reference_model is not None
    assert abs(metrics["learner/kl_reference"]) < 1e-6, "policy == reference on the first step"
    for _ in range(3):
        metrics = learner.train_step(_full_batch(learner, tok))
    assert metrics["learner/kl_reference"] > 1e-4
    frozen = [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(learner.reference_model, eqx.is_array))]
    assert all(np.array_equal(a, b) for a, b in zip(frozen, initial, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(learner.weights(), initial, strict=True))


@pytest.mark.parametrize(
    "loss",
    [
        LossConfig(),  # decoupled: kept tokens depend on the proximal logprobs
        LossConfig(objective="ppo", tis_cap=1.5, aggregation="sequence_mean", kl_coef=0.5, kl_estimator="k2"),
        LossConfig(objective="ppo", aggregation="fixed_budget", max_response_tokens=16),
        LossConfig(objective="ppo", sequence_correction="seq_tis", sequence_cap=1.5),
        # MIS and token masks: kept tokens depend on the proximal logprobs; GSPO: one ratio per sequence
        LossConfig(
            objective="gspo",
            sequence_correction="mis",
            sequence_band=(0.1, 10.0),
            token_mask_band=(0.3, 3.0),
            aggregation="sequence_mean",
        ),
    ],
)
def test_microbatch_accumulation_equals_the_full_batch_step(loss):
    tok, full = _learner(loss=loss)
    _, accumulated = _learner(loss=loss, microbatches=4)
    _use_sgd(full)
    _use_sgd(accumulated)
    batch = _full_batch(full, tok, noise=0.5)
    if loss.kl_coef > 0:  # a reference that differs from the policy, so that the KL term has a gradient
        for learner in (full, accumulated):
            learner.freeze_reference()
            params = eqx.filter(learner.model, eqx.is_inexact_array)
            learner.model = eqx.apply_updates(learner.model, jax.tree_util.tree_map(lambda x: -0.01 * x, params))
    before = full.weights()
    m_full, m_acc = full.train_step(batch), accumulated.train_step(batch)
    for w, a, b in zip(before, full.weights(), accumulated.weights(), strict=True):
        # SGD with step 1: each update is minus the gradient. Accumulating in another order rounds differently, so the
        # updates agree to float32's relative precision, not an absolute one (GSPO's sequence ratio here reaches ~9.5,
        # and the embedding's update ~7: measured 4e-6 relative); a wrong share or a lost microbatch is order 1.
        np.testing.assert_allclose(b - w, a - w, atol=1e-5 * max(1.0, float(np.abs(a - w).max())))
    keys = ("loss", "pg_loss", "grad_norm", "ratio/mean", "ratio/max", "entropy", "kl_sampler", "masked_frac")
    for key in (*keys, "masked_seq_frac", "mismatch/kl_k3", "mismatch/chi2_seq", "mismatch/seq_ratio/max"):
        np.testing.assert_allclose(m_acc[f"learner/{key}"], m_full[f"learner/{key}"], rtol=1e-4, atol=1e-6)
    assert m_full["learner/grad_norm"] > 0


def test_rows_must_split_into_minibatches_and_microbatches():
    tok, learner = _learner(microbatches=3)
    with pytest.raises(ValueError, match="microbatches=3"):
        learner.train_step(_rl_batch(learner, tok, "yes", "no"))
    with pytest.raises(ValueError, match="minibatches"):
        LearnerConfig(minibatches=0)


def test_minibatches_and_epochs_make_several_optimizer_steps_in_one_version():
    tok, learner = _learner(minibatches=2, epochs=2)
    metrics = learner.train_step(_full_batch(learner, tok))
    assert learner.version == 1
    assert metrics["learner/optimizer_steps"] == 4 and learner.optimizer_steps == 4
    steps = learner.step_metrics
    assert len(steps) == 4
    # The proximal logprobs are the weights before the batch's first step: exactly the first minibatch's.
    assert steps[0]["learner/ratio/min"] == 1.0 and steps[0]["learner/ratio/max"] == 1.0
    assert steps[1]["learner/ratio/max"] != 1.0 and steps[2]["learner/ratio/max"] != 1.0
    assert all(np.isfinite(s["learner/loss"]) for s in steps)
    assert metrics["learner/trained_tokens"] == sum(s["learner/trained_tokens"] for s in steps[:2])
    metrics = learner.train_step(_full_batch(learner, tok))
    assert learner.version == 2 and metrics["learner/optimizer_steps"] == 8


def _np_learning_rate(cfg: OptimizerConfig, t: int) -> float:
    """The schedule written from its definition: linear warmup, then constant / linear / cosine decay."""
    w, peak, m = cfg.warmup_steps, cfg.learning_rate, cfg.min_lr_ratio
    if t < w:
        return peak * t / w
    if cfg.schedule == "constant":
        return peak
    s = min(t - w, cfg.decay_steps) / cfg.decay_steps
    if cfg.schedule == "linear":
        return peak * (1 - (1 - m) * s)
    return peak * (m + (1 - m) * 0.5 * (1 + np.cos(np.pi * s)))


@pytest.mark.parametrize(
    "schedule",
    [
        dict(schedule="constant", warmup_steps=3),
        dict(schedule="linear", warmup_steps=2, decay_steps=5),
        dict(schedule="cosine", warmup_steps=0, decay_steps=6, min_lr_ratio=0.1),
        dict(schedule="cosine", warmup_steps=4, decay_steps=4),
    ],
)
def test_learning_rate_schedules_match_formula_and_drive_the_optimizer(schedule):
    """lr_at follows the formula, and the optimizer applies it: under a constant gradient Adam's step is
    -lr_t·g/(|g| + ε) (bias-corrected moments equal g and g²), so each update's size is that step's rate."""
    cfg = OptimizerConfig(learning_rate=0.01, max_grad_norm=None, eps=1e-12, **schedule)
    steps = 12
    expected = np.array([_np_learning_rate(cfg, t) for t in range(steps)])
    np.testing.assert_allclose([cfg.lr_at(t) for t in range(steps)], expected, rtol=1e-6, atol=1e-12)
    opt = cfg.build()
    params = {"w": np.ones(3, np.float32)}
    grads = {"w": np.array([0.5, -2.0, 1.0], np.float32)}
    state = opt.init(params)
    sizes = []
    for _ in range(steps):
        updates, state = opt.update(grads, state, params)
        sizes.append(-np.asarray(updates["w"]) * np.sign(grads["w"]))
    np.testing.assert_allclose(np.array(sizes), np.repeat(expected[:, None], 3, axis=1), rtol=1e-5, atol=1e-9)


def test_decaying_schedules_need_decay_steps():
    with pytest.raises(ValueError, match="decay_steps"):
        OptimizerConfig(schedule="cosine")
    with pytest.raises(ValueError, match="schedule must be one of"):
        OptimizerConfig(schedule="step")


def test_a_non_finite_loss_stops_training_at_that_step_naming_it():
    tok, learner = _learner()
    batch = _rl_batch(learner, tok, "yes", "no")
    learner.train_step(batch)
    poisoned = _rl_batch(learner, tok, "yes", "no")
    poisoned.advantages = np.where(poisoned.loss_mask, np.nan, 0.0).astype(np.float32)
    with pytest.raises(NonFiniteTrainingError, match=r"^learner step 2 \(optimizer step 2\): loss is nan; stopping"):
        learner.train_step(poisoned)


def test_a_nan_learning_rate_stops_training_at_the_first_step_it_shows():
    """The run's config refuses a NaN learning rate; built in code past that check, the learner still stops: the
    first step's loss and gradient norm (taken at the weights before it) are finite, its update is NaN, and the
    second step names itself."""
    with deferred_checks():
        tok, learner = _learner(lr=float("nan"))
    learner.train_step(_rl_batch(learner, tok, "yes", "no"))
    with pytest.raises(NonFiniteTrainingError, match=r"^learner step 2 \(optimizer step 2\): (loss|grad_norm) is nan"):
        learner.train_step(_rl_batch(learner, tok, "yes", "no"))
