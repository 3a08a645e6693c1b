"""Hugging Face checkpoints: export the policy, reload it through Levanter's converter, get identical logits."""

from __future__ import annotations

import dataclasses
import json

import equinox as eqx
import fsspec
import haliax as hax
import jax
import numpy as np
import pytest
from transformers import AutoConfig, AutoTokenizer

from marin_rl.model.build import build_model
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.model.hf import export_hf_checkpoint
from marin_rl.model.logprobs import packed_attention_mask, token_logprobs
from marin_rl.replay.packing import Sequence, pack
from marin_rl.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def trained(tokenizer):
    """The tiny Llama with every parameter perturbed, so that a reload cannot pass by re-initialising."""
    model = build_model(ModelConfig(architecture=tiny_llama(), seed=3), len(tokenizer))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
    leaves = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, leaves), static)


def _batch(tokenizer):
    texts = [("12+30=", "42"), ("Hello, ", "world!"), ("a", "bcdef"), ("x*y", "=z")]
    seqs = [Sequence.supervised(tokenizer(p)["input_ids"], tokenizer(c)["input_ids"]) for p, c in texts]
    batch, placed = pack(seqs, 2, 24)
    assert len(placed) == len(seqs)
    return batch


def _outputs(model, batch):
    axes = (hax.Axis("batch", batch.num_rows), hax.Axis("position", batch.seq_len))
    ids = hax.named(batch.input_ids, axes)
    pos, seg = hax.named(batch.position_ids, axes), hax.named(batch.segment_ids, axes)
    lp, ent = token_logprobs(model, ids, pos, seg)
    logits = model(ids, attn_mask=packed_attention_mask(seg), pos_ids=pos)
    return np.asarray(logits.array), np.asarray(lp.array), np.asarray(ent.array)


def _assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


def test_export_then_reload_gives_identical_logits(tmp_path, tokenizer, trained):
    out = tmp_path / "hf" / "step-3"
    export_hf_checkpoint(trained, tokenizer, str(out))
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    arch = tiny_llama()
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == len(tokenizer)
    assert config["hidden_size"] == arch.hidden_dim
    assert config["intermediate_size"] == arch.intermediate_dim
    assert config["num_hidden_layers"] == arch.num_layers
    assert config["num_attention_heads"] == arch.num_heads
    assert config["num_key_value_heads"] == arch.num_kv_heads
    assert config["eos_token_id"] == tokenizer.eos_token_id

    # transformers reads it as an ordinary checkpoint (no torch needed for config and tokenizer).
    hf_config = AutoConfig.from_pretrained(out)
    assert hf_config.model_type == "llama" and hf_config.vocab_size == len(tokenizer)
    hf_tok = AutoTokenizer.from_pretrained(out)
    assert hf_tok("12+30=42")["input_ids"] == tokenizer("12+30=42")["input_ids"]
    assert hf_tok.chat_template == tokenizer.chat_template

    reloaded = build_model(ModelConfig(architecture=tiny_llama(), init_from_hf=str(out)), len(tokenizer))
    for leaf in jax.tree_util.tree_leaves(eqx.filter(reloaded, eqx.is_inexact_array)):
        assert leaf.dtype == np.float32
    batch = _batch(tokenizer)
    _assert_same(_outputs(trained, batch), _outputs(reloaded, batch))


def test_reload_with_a_longer_context_keeps_the_weights(tmp_path, tokenizer, trained):
    """The run raises the architecture's max_seq_len to the run's; that must not block loading."""
    export_hf_checkpoint(trained, tokenizer, str(tmp_path))
    arch = dataclasses.replace(tiny_llama(), max_seq_len=256)
    reloaded = build_model(ModelConfig(architecture=arch, init_from_hf=str(tmp_path)), len(tokenizer))
    batch = _batch(tokenizer)
    _assert_same(_outputs(trained, batch), _outputs(reloaded, batch))


def test_fsspec_url_round_trip(tokenizer, trained):
    url = "memory://marin_rl_test/hf/step-1"
    try:
        export_hf_checkpoint(trained, tokenizer, url)
        fs, root = fsspec.core.url_to_fs(url)
        assert fs.exists(f"{root}/model.safetensors") and fs.exists(f"{root}/config.json")
        reloaded = build_model(ModelConfig(architecture=tiny_llama(), init_from_hf=url), len(tokenizer))
        batch = _batch(tokenizer)
        _assert_same(_outputs(trained, batch), _outputs(reloaded, batch))
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists("/marin_rl_test"):
            fs.rm("/marin_rl_test", recursive=True)


def test_vocab_mismatch_is_a_clear_error(tmp_path, tokenizer, trained):
    export_hf_checkpoint(trained, tokenizer, str(tmp_path))
    bigger = len(tokenizer) + 64
    with pytest.raises(ValueError, match=rf"vocabulary of {len(tokenizer)} tokens but the tokenizer has {bigger}"):
        build_model(ModelConfig(architecture=tiny_llama(), init_from_hf=str(tmp_path)), bigger)


def test_padded_checkpoint_vocabulary_is_kept(tmp_path, tokenizer, trained):
    export_hf_checkpoint(trained, tokenizer, str(tmp_path))
    smaller = len(tokenizer) - 8
    reloaded = build_model(ModelConfig(architecture=tiny_llama(), init_from_hf=str(tmp_path)), smaller)
    assert reloaded.Vocab.size == len(tokenizer)


def test_architecture_mismatch_is_a_clear_error(tmp_path, tokenizer, trained):
    export_hf_checkpoint(trained, tokenizer, str(tmp_path))
    arch = dataclasses.replace(tiny_llama(), intermediate_dim=256)
    with pytest.raises(ValueError, match="intermediate_size: configured 256 != checkpoint 512"):
        build_model(ModelConfig(architecture=arch, init_from_hf=str(tmp_path)), len(tokenizer))


def test_missing_checkpoint_is_a_clear_error(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="cannot read a Hugging Face config.json"):
        build_model(ModelConfig(init_from_hf=str(tmp_path / "nope")), len(tokenizer))


def test_export_every_must_be_non_negative():
    with pytest.raises(ValueError, match="model.export_every"):
        ModelConfig(export_every=-1)


def test_learner_starts_from_and_exports_hf(tmp_path, tokenizer, trained):
    from marin_rl.learner.config import LearnerConfig
    from marin_rl.learner.learner import Learner

    export_hf_checkpoint(trained, tokenizer, str(tmp_path / "init"))
    learner = Learner(ModelConfig(init_from_hf=str(tmp_path / "init")), LearnerConfig(), len(tokenizer))
    batch = _batch(tokenizer)
    np.testing.assert_allclose(learner.logprobs(batch), _outputs(trained, batch)[1], rtol=1e-6, atol=1e-6)
    learner.export_hf(str(tmp_path / "out"), tokenizer)
    again = build_model(ModelConfig(init_from_hf=str(tmp_path / "out")), len(tokenizer))
    _assert_same(_outputs(trained, batch), _outputs(again, batch))
