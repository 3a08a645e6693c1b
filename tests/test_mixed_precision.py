"""Mixed precision (`model.compute_dtype`, `marin_rl.model.precision`): at bfloat16 the parameters and optimizer
state stay float32, the forward pass computes in bfloat16 (its logprobs differ from float32's by bfloat16's rounding,
not more), supervised and RL steps still learn, and an engine serving the weights cast to bfloat16 samples tokens
whose logprobs the bfloat16 learner reproduces to a measured bound. 'auto' is float32 on CPUs, bfloat16 elsewhere."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from random_packed_batch import random_packed_batch
from test_dense_engine import _request

from marin_rl.envs.arithmetic import AdditionEnvironment
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.learner.config import LearnerConfig, WarmStartConfig
from marin_rl.learner.learner import Learner
from marin_rl.learner.train_state import TrainState
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.model.precision import cast_to_compute, resolve_compute_dtype
from marin_rl.model.value import token_values, value_model_from
from marin_rl.replay.packing import Sequence, pack
from marin_rl.tokenizer import build_char_tokenizer


def _copy(tree):
    return jax.tree_util.tree_map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, tree, is_leaf=eqx.is_array)


def _dtypes(tree) -> set[str]:
    return {str(x.dtype) for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype")}


@pytest.fixture(scope="module")
def learners():
    """A float32 learner warm-started 30 steps, and a bfloat16 learner holding the same float32 parameters."""
    tok = build_char_tokenizer()
    env = AdditionEnvironment(tok, max_operand=49, num_eval=50)
    learner_config = LearnerConfig(warm_start=WarmStartConfig(steps=30))
    f32 = Learner(ModelConfig(architecture=tiny_llama(), compute_dtype="float32"), learner_config, len(tok))
    examples = [(env.encode_prompt(p), tok(p.answer)["input_ids"] + [tok.eos_token_id]) for p in env.train_problems()]
    f32.warm_start(examples, 64)
    bf16 = Learner(ModelConfig(architecture=tiny_llama(), compute_dtype="bfloat16"), learner_config, len(tok))
    bf16.load_state(f32.state())
    return tok, env, f32, bf16, examples


def test_auto_is_float32_on_cpus_and_bfloat16_on_accelerators():
    assert resolve_compute_dtype("auto", "cpu") == "float32"
    assert resolve_compute_dtype("auto", "gpu") == resolve_compute_dtype("auto", "tpu") == "bfloat16"
    assert resolve_compute_dtype("float32", "gpu") == "float32"
    with pytest.raises(ValueError, match="model.compute_dtype must be one of"):
        ModelConfig(compute_dtype="float16")


def test_bfloat16_computes_in_bfloat16_and_keeps_float32_parameters(learners):
    tok, env, f32, bf16, examples = learners
    assert f32.policy_setup.compute_dtype == "float32" and bf16.policy_setup.compute_dtype == "bfloat16"
    cast = cast_to_compute(bf16.model, "bfloat16")
    assert _dtypes(cast) == {"bfloat16"} and _dtypes(bf16.model) == {"float32"}
    seqs = [Sequence.supervised(p, c) for p, c in examples[:32]]
    batch, _ = pack(seqs, 16, 64)
    lp32, lp16 = f32.logprobs(batch), bf16.logprobs(batch)
    assert lp16.dtype == np.float32
    diff = np.abs(lp32 - lp16)[batch.loss_mask]
    # bfloat16 keeps 8 bits of mantissa: the forward differs (not 0), by far less than a nat
    assert 1e-4 < diff.mean() < 0.05 and diff.max() < 0.5, (diff.mean(), diff.max())
    # a supervised step at bfloat16: float32 parameters and optimizer state, the same loss to bfloat16's rounding
    steps = {}
    for name, learner in (("float32", f32), ("bfloat16", bf16)):
        start = TrainState(learner.model, learner.supervised_optimizer_state(learner.optimizer))
        steps[name] = learner.supervised_state_step(start, batch, learner.optimizer)
    state16, metrics16 = steps["bfloat16"]
    assert _dtypes(state16.model) == {"float32"} and _dtypes(state16.opt_state) <= {"float32", "int32"}
    loss16, loss32 = float(metrics16["loss"]), float(steps["float32"][1]["loss"])
    assert abs(loss16 - loss32) < 0.02 * loss32, (loss16, loss32)


def test_an_rl_step_at_bfloat16_matches_float32_to_its_rounding(learners):
    tok, env, f32, bf16, examples = learners
    state = f32.state()
    batch = random_packed_batch(0, 8, 64, len(tok), 3)
    metrics = {}
    for name, learner in (("float32", f32), ("bfloat16", bf16)):
        learner.load_state(_copy(state))  # a step donates its optimizer state
        metrics[name] = learner.train_step(batch)
        assert _dtypes(learner.model) == {"float32"}
    for key in ("learner/loss", "learner/grad_norm"):
        a, b = metrics["float32"][key], metrics["bfloat16"][key]
        assert np.isfinite(b) and abs(a - b) <= 0.05 * abs(a) + 1e-3, (key, a, b)
    for learner in (f32, bf16):
        learner.load_state(_copy(state))


def test_the_critic_computes_values_in_the_compute_dtype_and_returns_float32(learners):
    tok, env, f32, bf16, examples = learners
    critic = value_model_from(f32.model)  # its head starts at zero: give it weights
    noise = lambda x: x + 0.1 * jax.random.normal(jax.random.PRNGKey(0), x.shape, x.dtype)  # noqa: E731
    critic = eqx.tree_at(lambda m: m.head, critic, jax.tree_util.tree_map(noise, critic.head))
    batch, _ = pack([Sequence.supervised(p, c) for p, c in examples[:32]], 16, 64)
    ex = f32.place_batch(batch)
    args = (ex.input_ids, ex.position_ids, ex.segment_ids)
    v32, _ = token_values(critic, *args, "float32")
    v16, _ = token_values(critic, *args, "bfloat16")
    assert v16.array.dtype == jnp.float32
    diff = np.abs(np.asarray(v32.array) - np.asarray(v16.array))
    scale = np.abs(np.asarray(v32.array)).max()
    assert 0 < diff.max() <= 0.05 * max(scale, 1.0), (diff.max(), scale)


def test_a_bfloat16_learner_learns_from_scratch(learners):
    tok, env, f32, bf16, examples = learners
    learner = Learner(
        ModelConfig(architecture=tiny_llama(), compute_dtype="bfloat16"),
        LearnerConfig(warm_start=WarmStartConfig(steps=30)),
        len(tok),
    )
    losses = learner.warm_start(examples, 64)["losses"]
    assert all(np.isfinite(losses)) and losses[-1] < 0.35 * losses[0], losses


def test_an_engine_serving_bfloat16_samples_what_the_bfloat16_learner_scores(learners):
    """The sampler–learner gap at bfloat16 (measured; the loss's importance-ratio corrections handle it) next to the
    float32 one, on the same prompts and seeds."""
    tok, env, f32, bf16, examples = learners
    inference = InferenceConfig(max_seqs=64, max_seq_len=64, levanter=LevanterServerConfig(engine="dense"))
    gaps = {}
    for name, learner in (("float32", f32), ("bfloat16", bf16)):
        server = LevanterInferenceServer(learner.model, tok, inference, compute_dtype=name)
        assert _dtypes(server.context.model) == {name}
        prompts = [env.encode_prompt(p) for p in env.train_problems()[:48]]
        eos = [[tok.eos_token_id]]
        done = server.context.engine.generate([_request(p, 100 + i, 6, eos, rid=i) for i, p in enumerate(prompts)])
        seqs = []
        for prompt, tokens, logprobs in zip(prompts, done.tokens, done.logprobs, strict=True):
            s = Sequence.supervised(prompt, tokens)
            s.sampler_logprobs[len(prompt) :] = logprobs
            seqs.append(s)
        batch, _ = pack(seqs, 16, 64)
        gaps[name] = np.abs(learner.logprobs(batch) - batch.sampler_logprobs)[batch.loss_mask]
    print({k: (float(v.mean()), float(v.max())) for k, v in gaps.items()})
    assert gaps["float32"].max() <= 1e-4
    assert gaps["bfloat16"].max() <= 0.1 and gaps["bfloat16"].mean() <= 0.02
