"""The learner: versions, the on-policy ratio, and that its updates move probability the right way."""

import numpy as np

from marin_rl.learner.learner import Learner, LearnerConfig, OptimizerConfig, WarmStartConfig
from marin_rl.learner.model import ModelConfig, tiny_llama
from marin_rl.replay.packing import Sequence, pack
from marin_rl.tokenizer import build_char_tokenizer


def _learner(lr=1e-3, warm_steps=0):
    tok = build_char_tokenizer()
    cfg = LearnerConfig(
        optimizer=OptimizerConfig(learning_rate=lr), warm_start=WarmStartConfig(steps=warm_steps, batch_rows=8)
    )
    return tok, Learner(ModelConfig(architecture=tiny_llama()), cfg, len(tok))


def _rl_batch(learner, tok, good: str, bad: str):
    """On-policy rollouts of 'q:' -> good (advantage +1) and -> bad (advantage -1), sampler logprobs = learner's."""
    prompt = tok("q:")["input_ids"]
    seqs = []
    for completion, adv in ((good, 1.0), (bad, -1.0)):
        ids = tok(completion)["input_ids"]
        s = Sequence.supervised(prompt, ids)
        s.advantages = np.where(s.loss_mask, adv, 0.0).astype(np.float32)
        s.versions = np.where(s.loss_mask, learner.version, -1).astype(np.int32)
        seqs += [s] * 4
    batch, _ = pack(seqs, 4, 32)
    batch.policy_logprobs = np.where(batch.loss_mask, learner.logprobs(batch), 0.0).astype(np.float32)
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
    assert metrics["learner/logprob_diff_behaviour/max_abs"] < 1e-5
    assert metrics["learner/trained_tokens"] == int(batch.loss_mask.sum())


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


def test_weights_round_trip_shapes():
    tok, learner = _learner()
    leaves = learner.weights()
    assert sum(x.size for x in leaves) == learner.num_params
    assert all(isinstance(x, np.ndarray) for x in leaves)
