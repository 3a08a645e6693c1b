"""The policy model's training-speed options keep its numbers: gradients, attention blocks, rematerialisation, and
the single-pass logprob/entropy head, each against an independent reference."""

from __future__ import annotations

import dataclasses
import itertools

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl.model.build import build_model, resolved_architecture
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.model.linear_gradients import LayoutAwareDotGeneral, _contract
from marin_rl.model.logprobs import packed_attention_mask, token_logprobs

VOCAB = 128


def _packed(rows=4, seq=64, seed=0):
    """Rows of three packed segments each, with position ids restarting per segment."""
    rng = np.random.default_rng(seed)
    segs = np.zeros((rows, seq), np.int32)
    pos = np.zeros((rows, seq), np.int32)
    for r in range(rows):
        cuts = [0, *sorted(rng.choice(np.arange(4, seq - 4), 2, replace=False)), seq]
        for s in range(3):
            segs[r, cuts[s] : cuts[s + 1]] = s
            pos[r, cuts[s] : cuts[s + 1]] = np.arange(cuts[s + 1] - cuts[s])
    axes = (hax.Axis("batch", rows), hax.Axis("position", seq))
    ids = hax.named(jnp.asarray(rng.integers(0, VOCAB, (rows, seq)), jnp.int32), axes)
    return ids, hax.named(jnp.asarray(pos), axes), hax.named(jnp.asarray(segs), axes)


def _loss_and_grads(model, temperature=0.7):
    ids, pos, seg = _packed()
    weights = jnp.linspace(-1.0, 1.0, ids.axes[1].size)

    def loss(m):
        lp, ent = token_logprobs(m, ids, pos, seg, temperature=temperature)
        return jnp.sum(lp.array * weights) + 0.1 * jnp.sum(ent.array)

    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model)
    return float(value), [np.asarray(g) for g in jax.tree_util.tree_leaves(grads)]


def _gqa_llama():
    # grouped-query attention: the q projection has (kv_head, q_heads_per_group, head_size) output axes
    return dataclasses.replace(tiny_llama(), num_kv_heads=2)


def _custom_vjp_calls(jaxpr) -> int:
    """Number of custom-VJP calls in a jaxpr, counting those inside scans, jits and other sub-jaxprs."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name.startswith("custom_vjp_call")
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
                if hasattr(sub, "eqns"):
                    n += _custom_vjp_calls(sub)
    return n


def _traced_rule_calls(model) -> int:
    ids, pos, seg = _packed()
    params, static = eqx.partition(model, eqx.is_array)
    closed = jax.make_jaxpr(lambda p: token_logprobs(eqx.combine(p, static), ids, pos, seg)[0].array.sum())(params)
    return _custom_vjp_calls(closed.jaxpr)


def test_layout_aware_gradients_equal_the_default_rule():
    base = ModelConfig(architecture=_gqa_llama(), cpu_attention_block_size=None)
    default = build_model(dataclasses.replace(base, layout_aware_gradients=False), VOCAB)
    aware = build_model(base, VOCAB)
    ops = [x for x in jax.tree_util.tree_leaves(aware, is_leaf=lambda x: isinstance(x, LayoutAwareDotGeneral))]
    assert sum(isinstance(x, LayoutAwareDotGeneral) for x in ops) == 8  # q, k, v, o, gate, up, down, lm head
    # The rule is taken, not just installed: haliax hands every dot an `out_sharding` over the empty mesh, and a
    # rule that gave way to any extra option ran JAX's own rule on every layer (the scanned layer body is traced
    # once: its 7 projections, plus the lm head).
    assert _traced_rule_calls(default) == 0
    assert _traced_rule_calls(aware) == 8
    v0, g0 = _loss_and_grads(default)
    v1, g1 = _loss_and_grads(aware)
    assert v0 == v1
    assert len(g0) == len(g1)
    for a, b in zip(g0, g1, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * np.abs(a).max())


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_contract_matches_einsum_for_every_output_order(order):
    rng = np.random.default_rng(1)
    a = rng.normal(size=(3, 5, 4)).astype(np.float32)  # dims: x, k, y
    b = rng.normal(size=(5, 6)).astype(np.float32)  # dims: k, z
    free = [(0, 0), (0, 2), (1, 1)]  # a.x, a.y, b.z
    out = [free[i] for i in order]
    names = {(0, 0): "x", (0, 2): "y", (1, 1): "z"}
    expected = np.einsum(f"xky,kz->{''.join(names[o] for o in out)}", a, b)
    got = _contract(jnp.asarray(a), jnp.asarray(b), [(1, 0)], out, None)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def test_blockwise_cpu_attention_matches_plain_attention_on_packed_rows():
    arch = _gqa_llama()
    plain = build_model(ModelConfig(architecture=arch, seed=2, cpu_attention_block_size=None), VOCAB)
    blocked_config = ModelConfig(architecture=arch, seed=2, cpu_attention_block_size=16)
    assert resolved_architecture(blocked_config).flash_attention_block_size == 16
    assert resolved_architecture(dataclasses.replace(blocked_config, cpu_attention_block_size=None)) == arch
    explicit = dataclasses.replace(arch, flash_attention_block_size=32)
    assert resolved_architecture(dataclasses.replace(blocked_config, architecture=explicit)) == explicit
    blocked = build_model(blocked_config, VOCAB)
    ids, pos, seg = _packed()  # 64 positions: 4 × 4 blocks of 16
    lp0, ent0 = token_logprobs(plain, ids, pos, seg)
    lp1, ent1 = token_logprobs(blocked, ids, pos, seg)
    np.testing.assert_allclose(np.asarray(lp1.array), np.asarray(lp0.array), atol=2e-5)
    np.testing.assert_allclose(np.asarray(ent1.array), np.asarray(ent0.array), atol=2e-5)
    v0, g0 = _loss_and_grads(plain)
    v1, g1 = _loss_and_grads(blocked)
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    for a, b in zip(g0, g1, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-4 * np.abs(a).max())


def test_gradient_checkpointing_is_a_model_option_that_keeps_the_gradients():
    arch = dataclasses.replace(tiny_llama(), gradient_checkpointing=True)  # Levanter's own default is on
    assert resolved_architecture(ModelConfig(architecture=arch)).gradient_checkpointing is False
    assert resolved_architecture(ModelConfig(architecture=arch, gradient_checkpointing=None)).gradient_checkpointing
    cfg = ModelConfig(architecture=arch, gradient_checkpointing="recompute", cpu_attention_block_size=None)
    assert resolved_architecture(cfg).gradient_checkpointing == "recompute"
    v0, g0 = _loss_and_grads(build_model(dataclasses.replace(cfg, gradient_checkpointing=False), VOCAB))
    v1, g1 = _loss_and_grads(build_model(cfg, VOCAB))
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    for a, b in zip(g0, g1, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6 * np.abs(a).max())
    with pytest.raises(ValueError, match="model.gradient_checkpointing must be"):
        ModelConfig(gradient_checkpointing="sometimes")
    with pytest.raises(ValueError, match="model.cpu_attention_block_size: must be >= 1"):
        ModelConfig(cpu_attention_block_size=0)


def test_logprobs_and_entropy_equal_a_float64_log_softmax():
    model = build_model(ModelConfig(architecture=tiny_llama(), seed=4), VOCAB)
    ids, pos, seg = _packed(rows=2, seq=32)
    lp, ent = token_logprobs(model, ids, pos, seg, temperature=0.8)
    logits = model(ids, attn_mask=packed_attention_mask(seg), pos_ids=pos)
    logits = np.asarray(logits.rearrange((*ids.axes, model.Vocab)).array, np.float64) / 0.8
    log_p = logits - logits.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    entropy = -(np.exp(log_p) * log_p).sum(-1)
    ids_np = np.asarray(ids.array)
    expected_lp = np.zeros(ids_np.shape)
    expected_ent = np.zeros(ids_np.shape)
    for b in range(ids_np.shape[0]):
        for t in range(1, ids_np.shape[1]):
            expected_lp[b, t] = log_p[b, t - 1, ids_np[b, t]]
            expected_ent[b, t] = entropy[b, t - 1]
    np.testing.assert_allclose(np.asarray(lp.array), expected_lp, atol=2e-5)
    np.testing.assert_allclose(np.asarray(ent.array), expected_ent, atol=2e-5)
