"""LoRA: adapter gradients against the merged model's, a frozen base, adapter-only versions that servers merge, an
exact resume, and the configuration's refusals."""

import asyncio
import dataclasses
import json
from pathlib import Path

import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.adaptor.lora import LORA_R, LoraLinear
from random_adapters import perturbed_adapters
from random_packed_batch import random_packed_batch
from seeded_checkpoints import DATA, materialise

from marin_rl.envs.arithmetic import AdditionEnvironment
from marin_rl.envs.base import SamplingParams, run_groups
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.learner.checkpoint import load_learner_state, save_learner_state
from marin_rl.learner.config import LearnerConfig, LossConfig, WarmStartConfig
from marin_rl.learner.learner import Learner
from marin_rl.learner.step import policy_grads
from marin_rl.model import lora
from marin_rl.model.build import build_model
from marin_rl.model.config import LoraConfig, ModelConfig, tiny_llama
from marin_rl.replay.packing import Sequence, pack
from marin_rl.tokenizer import build_char_tokenizer

RANK = 2


def _lora_learner(vocab: int, kl_coef: float = 0.0, seed: int = 0) -> Learner:
    config = LearnerConfig(lora=LoraConfig(rank=RANK, alpha=4.0, init="zero_b", seed=seed))
    config.loss = LossConfig(kl_coef=kl_coef)
    learner = Learner(ModelConfig(architecture=tiny_llama()), config, vocab)
    assert learner.add_adapters()
    return learner


def _lora_layers(model) -> list[LoraLinear]:
    is_lora = lambda x: isinstance(x, LoraLinear)  # noqa: E731
    return [x for x in jax.tree_util.tree_leaves(model, is_leaf=is_lora) if is_lora(x)]


def _linear_weights(model) -> list:
    """The weight of every linear layer, in tree order (of a plain model)."""
    is_linear = lambda x: isinstance(x, hnn.Linear)  # noqa: E731
    return [x.weight for x in jax.tree_util.tree_leaves(model, is_leaf=is_linear) if is_linear(x)]


def test_adapter_gradients_equal_the_merged_models_gradient_through_the_chain_rule():
    vocab = 40
    learner = _lora_learner(vocab)
    model = perturbed_adapters(learner.model)
    batch = random_packed_batch(0, rows=4, seq=32, vocab=vocab, segments=3)
    ex = learner.place_batch(batch)
    grads, _ = policy_grads(learner.policy_setup, model, None, ex, None, learner.loss)

    # Reference: differentiate the merged (plain) model with the same loss, then dL/dA = s·Bᵀ·G, dL/dB = s·G·Aᵀ,
    # G = dL/dW of each adapted weight W' = W + s·B·A.
    plain = Learner(ModelConfig(architecture=tiny_llama()), LearnerConfig(), vocab)
    merged = lora.merged(model)
    full_grads, _ = policy_grads(plain.policy_setup, merged, None, ex, None, plain.loss)
    layers = _lora_layers(model)
    grad_layers = _lora_layers(lora.join(grads, lora.split(model)[1]))
    merged_weights = _linear_weights(merged)
    weight_grads = _linear_weights(full_grads)
    checked = 0
    for layer, grad_layer in zip(layers, grad_layers, strict=True):
        # the merged weight of this layer: the one whose value is W + s·B·A
        target = layer.merge().weight
        [g] = [
            g
            for w, g in zip(merged_weights, weight_grads, strict=True)
            if w.axes == target.axes and bool(jnp.all(w.array == target.array))
        ]
        A, B, s = layer.lora.lora_A.weight, layer.lora.lora_B.weight, layer.lora.scale
        out_axes = [a for a in B.axes if a.name != LORA_R and a not in A.axes]
        in_axes = [a for a in A.axes if a.name != LORA_R and a not in B.axes]
        ref_dA = (hax.dot(B, g, axis=out_axes) * s).rearrange(A.axes).array
        ref_dB = (hax.dot(g, A, axis=in_axes) * s).rearrange(B.axes).array
        np.testing.assert_allclose(grad_layer.lora.lora_A.weight.array, ref_dA, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(grad_layer.lora.lora_B.weight.array, ref_dB, rtol=1e-4, atol=1e-6)
        assert float(jnp.max(jnp.abs(ref_dA))) > 0 and float(jnp.max(jnp.abs(ref_dB))) > 0
        checked += 1
    assert checked == 7 * 1, checked  # q, k, v, o, gate, up, down (the layers are stacked: one module each)
    base_grads = [x for layer in _lora_layers(grads) for x in lora.array_leaves(layer.wrapped)]
    assert base_grads == [], "the base gets no gradient"


def test_training_moves_only_the_adapters_and_the_optimizer_holds_only_theirs():
    vocab = 40
    learner = _lora_learner(vocab, kl_coef=0.05)
    base_before = [np.asarray(x) for x in lora.array_leaves(lora.without_adapters(learner.model))]
    adapters_before = [np.asarray(x) for x in lora.array_leaves(lora.split(learner.model)[0])]
    for seed in range(3):
        metrics = learner.train_step(random_packed_batch(seed, rows=4, seq=32, vocab=vocab, segments=3))
        assert np.isfinite(metrics["learner/loss"])
    assert learner.reference_model is None, "with LoRA the KL reference is the base, not a copy"
    base_after = lora.array_leaves(lora.without_adapters(learner.model))
    for before, after in zip(base_before, base_after, strict=True):
        np.testing.assert_array_equal(before, np.asarray(after))  # bit-identical
    adapters_after = lora.array_leaves(lora.split(learner.model)[0])
    assert any(not np.array_equal(b, np.asarray(a)) for b, a in zip(adapters_before, adapters_after, strict=True))
    adapter_elements = sum(x.size for x in adapters_after)
    state_elements = sum(x.size for x in jax.tree_util.tree_leaves(learner.opt_state) if x.ndim > 0)
    assert state_elements == 2 * adapter_elements, "AdamW's two moments, for the adapters only"
    sizes = lora.lora_bytes(learner.model)
    assert sizes["adapters"] < 0.1 * sizes["base"]


def test_checkpoint_resume_with_lora_continues_exactly(tmp_path):
    vocab = 40
    batches = [random_packed_batch(seed, rows=4, seq=32, vocab=vocab, segments=3) for seed in range(3)]
    learner = _lora_learner(vocab)
    learner.train_step(batches[0])
    path = str(tmp_path / "step-1")
    save_learner_state(learner, path, 1)
    expected = [learner.train_step(b)["learner/loss"] for b in batches[1:]]

    resumed = Learner(ModelConfig(architecture=tiny_llama()), learner.config, vocab)
    load_learner_state(resumed, path)
    assert lora.has_adapters(resumed.model) and resumed.version == 1
    got = [resumed.train_step(b)["learner/loss"] for b in batches[1:]]
    assert got == expected
    for a, b in zip(lora.array_leaves(learner.model), lora.array_leaves(resumed.model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_servers_merge_adapter_only_versions_and_sample_what_the_learner_scores():
    tok = build_char_tokenizer()
    env = AdditionEnvironment(tok, max_operand=49, num_eval=50)
    config = LearnerConfig(
        warm_start=WarmStartConfig(steps=30, cache_dir=None), lora=LoraConfig(rank=RANK, init="zero_b")
    )
    learner = Learner(ModelConfig(architecture=tiny_llama()), config, len(tok))
    examples = [(env.encode_prompt(p), tok(p.answer)["input_ids"] + [tok.eos_token_id]) for p in env.train_problems()]
    learner.warm_start(examples, 64)
    assert lora.has_adapters(learner.model)
    learner.model = perturbed_adapters(learner.model, scale=0.2)  # adapters that change the policy
    server = LevanterInferenceServer(
        build_model(ModelConfig(architecture=tiny_llama()), len(tok)),  # a server starts from the initial policy
        tok,
        InferenceConfig(max_seqs=64, max_seq_len=64, levanter=LevanterServerConfig(engine="paged", page_size=16)),
        lora=config.lora,
    )
    try:
        with pytest.raises(lora.MissingBaseError, match="before any base"):
            server.apply_weights(0, [np.asarray(x) for x in lora.publish_leaves(learner.model, full=False)])
        first = learner.weights()  # the first publish carries the base
        later = learner.weights()  # later ones the adapters alone
        assert len(later) < len(first) and sum(x.nbytes for x in later) < 0.1 * sum(x.nbytes for x in first)
        first = [np.array(x) for x in first]
        server.apply_weights(0, first)
        for x in first:  # a transport reuses its buffers (shared-memory slots): the server must have copied the base
            x[...] = 0
        learner.model = perturbed_adapters(learner.model, scale=0.2, seed=7)  # a new version: new adapters only
        server.apply_weights(1, learner.weights())
        address = server.start()
        sampling = SamplingParams(temperature=1.0, max_tokens=5)
        groups = asyncio.run(run_groups(env, [address], env.train_problems()[:32], 4, sampling))
    finally:
        server.stop()
    rollouts = [r for g in groups for r in g.rollouts]
    batch, placed = pack([Sequence.from_rollout(r, 0.0) for r in rollouts], 32, 64)
    assert len(placed) == len(rollouts)
    diff = np.abs(learner.logprobs(batch) - batch.sampler_logprobs)[batch.loss_mask]
    assert diff.size > 100
    assert diff.max() <= 1e-4, f"sampler/learner logprob mismatch with adapters: {diff.max()}"
    plain = Learner(ModelConfig(architecture=tiny_llama()), LearnerConfig(), len(tok))
    plain.model = lora.without_adapters(learner.model)
    assert np.abs(plain.logprobs(batch) - batch.sampler_logprobs)[batch.loss_mask].max() > 1e-2, (
        "the adapters must matter, or this test shows nothing"
    )


def test_lora_configuration_refusals():
    with pytest.raises(ValueError, match="learner.lora.init"):
        LoraConfig(rank=2, init="gaussian")
    with pytest.raises(ValueError, match="learner.lora.rank"):
        LoraConfig(rank=-1)
    with pytest.raises(ValueError, match="matches none"):
        lora.add_adapters(
            build_model(ModelConfig(architecture=tiny_llama()), 40), LoraConfig(rank=2, target_modules=["nope"])
        )
    with pytest.raises(ValueError, match="learner.lora.init_from_peft"):
        LoraConfig(rank=2, init_from_peft=" ")


@pytest.mark.gate_run  # a LoRA version carrying only adapters, and an in-run server replacement
def test_quickstart_lora_learns_ships_only_adapters_and_a_replaced_server_gets_the_base(tmp_path):
    import ray

    from marin_rl.config import parse_config
    from marin_rl.orchestrator.hooks import StepHook
    from marin_rl.orchestrator.orchestrator import Orchestrator

    out = tmp_path / "run"
    args = ["--config", "experiments/quickstart_lora.yaml", "--output_dir", str(out)]
    args += ["--orchestrator.num_steps", "60", "--orchestrator.eval_every", "60", "--orchestrator.max_staleness", "0"]
    orchestrator = Orchestrator(parse_config(args))
    orchestrator.hooks.hooks.append(
        StepHook("kill_server", 1, lambda step: ray.kill(orchestrator.servers.actors[0]) if step == 30 else None)
    )
    summary = orchestrator.run()
    assert summary["server_restarts"] == 1
    assert summary["eval_reward_end"] - summary["eval_reward_start"] >= 0.1, summary
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "learner/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 61))
    full_bytes = 4 * 557_696  # the quickstart policy in float32
    shipped = [r["broadcast/bytes"] for r in steps]
    assert sum(b > full_bytes for b in shipped) <= 1, "base + adapters travel once after the replacement"
    assert sorted(shipped)[len(shipped) // 2] <= 0.05 * full_bytes, "versions carry the adapters alone"
    # Every batch is on-policy: the served (merged) policy is the learner's, also after the restart. The servers
    # sample from W + s·BA and the learner computes W·x + s·B(A·x): equal but for float32 rounding, which moves the
    # worst token's logprob by up to ~1e-4 (measured: median 7e-6, 9.3e-5 alone, 1.75e-4 beside another test); a
    # stale or wrong version differs by 1e-2 or more.
    for r in steps:
        assert r["batches/staleness/max"] == 0
        assert r["learner/logprob_diff_sampler/max_abs"] < 5e-4, r["step"]
    assert (out / "hf" / "step-60" / "config.json").exists(), "the export is the merged policy"
    assert (out / "hf" / "step-60" / "peft" / "adapter_config.json").exists()


def test_exported_peft_adapters_load_back_as_the_same_adapters(tmp_path):
    tok = build_char_tokenizer()
    learner = _lora_learner(len(tok))
    learner.model = perturbed_adapters(learner.model, scale=0.1)
    export = tmp_path / "hf"
    learner.export_hf(str(export), tok)
    assert (export / "peft" / "adapter_model.safetensors").exists() and (export / "base" / "config.json").exists()
    config = json.loads((export / "peft" / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["base_model_name_or_path"] == str(export / "base")

    # A run that starts from the exported adapters (`init_from_peft`) holds exactly the same ones.
    again = LearnerConfig(lora=dataclasses.replace(learner.config.lora, init_from_peft=str(export / "peft"), seed=9))
    resumed = Learner(ModelConfig(architecture=tiny_llama()), again, len(tok))
    resumed.model = lora.without_adapters(learner.model)  # the same base
    assert resumed.add_adapters()
    for a, b in zip(lora.array_leaves(learner.model), lora.array_leaves(resumed.model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


PEFT_REFERENCE = DATA / "peft_reference"
"""A tiny Llama and rank-2 adapters in PEFT's format, their tensors seeded, and PEFT's logprobs with the adapters
applied and merged (`tests/peft_reference.py`, which also says how to compute them again)."""


def test_peft_adapters_give_peft_logprobs_and_export_as_they_were_read(tmp_path):
    """The learner that loads PEFT adapters (`init_from_peft`) onto their base gives the logprobs PEFT gives; its
    export holds the same adapter tensors bit for bit (so PEFT loads the export as it loaded them), and its merged
    checkpoint gives the logprobs of PEFT's own merge."""
    from safetensors.numpy import load_file

    tok = build_char_tokenizer()
    base = materialise(PEFT_REFERENCE / "base", tmp_path / "base", "peft_reference/base")
    adapters = materialise(PEFT_REFERENCE / "adapters", tmp_path / "adapters", "peft_reference/adapters")
    reference = json.loads((PEFT_REFERENCE / "reference.json").read_text())
    sequences = reference["sequences"]
    config = LearnerConfig(lora=LoraConfig(rank=RANK, alpha=4.0, init_from_peft=str(adapters)))
    learner = Learner(ModelConfig(architecture=tiny_llama(), init_from_hf=str(base)), config, len(tok))
    assert learner.add_adapters()
    rows = list(range(len(sequences)))
    batch, _ = pack([Sequence.supervised(s[:1], s[1:]) for s in sequences], len(sequences), 32, assignment=rows)

    def worst(ours, theirs) -> float:
        return max(float(np.max(np.abs(ours[r, 1 : len(s)] - np.asarray(theirs[r])))) for r, s in enumerate(sequences))

    assert worst(learner.logprobs(batch), reference["peft"]) <= 1e-4

    export = tmp_path / "export"
    learner.export_hf(str(export), tok)
    read, written = (load_file(str(d / "adapter_model.safetensors")) for d in (adapters, export / "peft"))
    assert sorted(written) == sorted(read), set(written) ^ set(read)
    for key, value in read.items():
        assert written[key].dtype == value.dtype and np.array_equal(written[key], value), key
    merged = Learner(ModelConfig(architecture=tiny_llama(), init_from_hf=str(export)), LearnerConfig(), len(tok))
    assert worst(merged.logprobs(batch), reference["merged"]) <= 1e-4


@pytest.mark.slow
def test_the_shipped_peft_reference_is_what_peft_computes(tmp_path):
    """PEFT, run now on the shipped base and adapters, gives the shipped logprobs (applied and merged): the
    reference the gate checks the learner against has not drifted from its source."""
    import subprocess

    from reference_python import reference_python

    base = materialise(PEFT_REFERENCE / "base", tmp_path / "base", "peft_reference/base")
    adapters = materialise(PEFT_REFERENCE / "adapters", tmp_path / "adapters", "peft_reference/adapters")
    shipped = json.loads((PEFT_REFERENCE / "reference.json").read_text())
    (tmp_path / "sequences.json").write_text(json.dumps(shipped["sequences"]))
    script = Path(__file__).with_name("peft_reference.py")
    args = [str(base), str(adapters), str(tmp_path / "sequences.json"), str(tmp_path / "out.json")]
    python = reference_python("torch, transformers, peft")
    done = subprocess.run([python, str(script), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    fresh = json.loads((tmp_path / "out.json").read_text())
    for name in ("peft", "merged"):
        for ours, theirs in zip(shipped[name], fresh[name], strict=True):
            delta = float(np.max(np.abs(np.asarray(ours) - np.asarray(theirs))))
            assert delta <= 1e-6, f"{name}: PEFT {fresh['versions']} now gives logprobs {delta:.2e} away"
