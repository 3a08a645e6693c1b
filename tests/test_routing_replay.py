"""Routing replay (`marin_rl.model.moe`, `learner.moe.routing_replay`): the dense engine records which experts each
token went to, the record travels with the rollout (wire, turn, Parquet store, packed batch), and the learner's
forward routed by it computes what the sampler computed, even where the two would route a near-tie differently; the
router keeps its gradient through the replayed gates."""

from __future__ import annotations

import asyncio
import base64
import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from levanter.layers.attention import AttentionMask
from levanter.models.mixtral import MixtralConfig
from levanter.models.qwen3_moe import Qwen3MoeConfig

from marin_rl.inference.dense_engine import DenseEngine
from marin_rl.inference.levanter_server import _FullDistributionSampler
from marin_rl.inference.routing_payload import decode_routes, encode_routes
from marin_rl.model import moe
from marin_rl.model.build import build_model
from marin_rl.model.config import ModelConfig

VOCAB = 61
LAYERS, K = 2, 2


def _architecture(family: str):
    common = dict(max_seq_len=64, hidden_dim=32, num_layers=LAYERS, num_heads=4, num_kv_heads=2)
    common |= dict(num_experts_per_tok=K, gradient_checkpointing=False, scan_layers=True)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, intermediate_dim=64, moe_intermediate_dim=32, num_experts=8, head_dim=8)
    return MixtralConfig(**common, intermediate_dim=32, n_routed_experts=8)


def _model(family: str, router_scale: float = 1.0, seed: int = 0):
    """A tiny random model of the family; `router_scale` < 1 shrinks the router's weights, so its top-k choices come
    with small margins (near-ties)."""
    model = build_model(ModelConfig(architecture=_architecture(family), seed=seed), VOCAB)
    return eqx.tree_at(_gate, model, _gate(model) * router_scale) if router_scale != 1.0 else model


def _gate(model):
    return moe.sparse_block(model.transformer.layers.stacked).gate.weight


def _one_device_mesh():
    return hax.partitioning.set_mesh(Mesh(np.array(jax.devices()[:1]), ("data",)))


def _logprobs(model, seqs: np.ndarray, routed: np.ndarray | None = None) -> np.ndarray:
    """Per-token logprobs of `seqs` (token t from the logits at t-1; column 0 dropped), routed by `routed` [batch,
    position, layers × k] when given."""
    with _one_device_mesh(), jax.default_matmul_precision("highest"):
        logp = np.asarray(_jit_log_softmax(model, jnp.asarray(seqs), None if routed is None else jnp.asarray(routed)))
    return np.take_along_axis(logp[:, :-1], seqs[:, 1:, None], axis=-1)[..., 0]


@eqx.filter_jit
def _jit_log_softmax(model, seqs, routed):
    axes = (hax.Axis("batch", seqs.shape[0]), hax.Axis("position", seqs.shape[1]))
    if routed is not None:
        model = moe.with_replayed_routing(
            model, hax.named(routed, (*axes, hax.Axis(moe.ROUTED_EXPERTS, routed.shape[-1])))
        )
    logits = model(hax.named(seqs, axes), attn_mask=AttentionMask.causal()).array
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def _own_routing(model, seqs: np.ndarray) -> np.ndarray:
    """The experts the model's own forward sends each token of `seqs` to: [batch, position, layers × k]."""
    with _one_device_mesh(), jax.default_matmul_precision("highest"):
        return np.asarray(_jit_own_routing(model, jnp.asarray(seqs)))


@eqx.filter_jit
def _jit_own_routing(model, seqs):
    axes = (hax.Axis("batch", seqs.shape[0]), hax.Axis("position", seqs.shape[1]))
    chosen = []
    x = model.embeddings.embed(hax.named(seqs, axes))
    for layer in model.transformer.layers.unstacked():
        h = x + layer.self_attn(x=layer.input_layernorm(x), mask=AttentionMask.causal(), key=None)
        _, experts, _ = moe.moe_forward(moe.sparse_block(layer), layer.post_attention_layernorm(h))
        chosen.append(experts.rearrange(("batch", "position", "top_experts")).array)
        out = layer(x, AttentionMask.causal(), key=None)
        x = out[0] if isinstance(out, tuple) else out
    return jnp.concatenate(chosen, axis=-1)


@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_the_block_routed_by_its_own_choices_computes_what_levanters_block_computes(family):
    """`moe_forward` is Levanter's sparse block with the top-k exposed: the same output bit for bit, and routing by
    the experts it chose (or by none: -1) changes nothing; other experts change the output."""
    model = _model(family)
    seqs = np.random.default_rng(0).integers(0, VOCAB, (3, 12))
    routed = _own_routing(model, seqs)
    assert routed.shape == (3, 12, LAYERS * K) and routed.min() >= 0 and routed.max() < 8
    own = _logprobs(model, seqs)
    np.testing.assert_array_equal(_logprobs(model, seqs, routed), own)
    np.testing.assert_array_equal(_logprobs(model, seqs, np.full_like(routed, moe.NO_EXPERT)), own)
    other = (routed + 1) % 8
    assert np.abs(_logprobs(model, seqs, other) - own).max() > 1e-2
    layer = model.transformer.layers.unstacked()[0]
    x = hax.random.normal(jax.random.PRNGKey(1), (hax.Axis("batch", 2), hax.Axis("position", 5), layer.config.Embed))
    with _one_device_mesh():
        ours, _, _ = moe.moe_forward(moe.sparse_block(layer), x)
        theirs = moe.sparse_block(layer)(x)
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    np.testing.assert_array_equal(np.asarray(ours.array), np.asarray(theirs.array))


@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_the_router_keeps_its_gradient_through_the_replayed_gates(family):
    """Replaying the experts the router itself chose gives the router exactly the gradient of the unreplayed forward
    (the gates are its probabilities at those experts), and it is not zero."""
    model = _model(family)
    seqs = np.random.default_rng(1).integers(0, VOCAB, (2, 10))
    routed = _own_routing(model, seqs)
    axes = (hax.Axis("batch", 2), hax.Axis("position", 10))
    ids = hax.named(jnp.asarray(seqs), axes)
    replay = hax.named(jnp.asarray(routed), (*axes, hax.Axis(moe.ROUTED_EXPERTS, LAYERS * K)))

    def loss(m, replayed: bool):
        m = moe.with_replayed_routing(m, replay) if replayed else m
        logits = m(ids, attn_mask=AttentionMask.causal()).array
        return jnp.mean(jax.nn.log_softmax(logits, axis=-1)[..., 3])

    with _one_device_mesh(), jax.default_matmul_precision("highest"):
        plain = _gate(eqx.filter_jit(eqx.filter_grad(lambda m: loss(m, False)))(model)).array
        replayed = _gate(eqx.filter_jit(eqx.filter_grad(lambda m: loss(m, True)))(model)).array
    assert float(jnp.abs(plain).max()) > 1e-4
    np.testing.assert_allclose(np.asarray(replayed), np.asarray(plain), rtol=1e-5, atol=1e-7)


def test_replay_refuses_a_record_of_another_width():
    model = _model("qwen3_moe")
    axes = (hax.Axis("batch", 1), hax.Axis("position", 4), hax.Axis(moe.ROUTED_EXPERTS, 3))
    with pytest.raises(ValueError, match=r"width 3 for a model of 2 expert layers × 2 experts per token \(4\)"):
        moe.with_replayed_routing(model, hax.zeros(axes, dtype=jnp.int16))


def _request(prompt, seed, max_new):
    from test_dense_engine import _request as request

    return request(prompt, seed, max_new)


@pytest.fixture(scope="module")
def engines():
    """A dense engine per family, built once (a later model of the same structure is served without recompiling)."""
    out = {}
    for family in ("qwen3_moe", "mixtral"):
        model = _model(family)
        sampler = _FullDistributionSampler(model.Vocab)
        out[family] = DenseEngine(
            model, sampler, max_seqs=8, max_seq_len=64, max_stop_seqs=1, max_stop_tokens=1, record_routing=True
        )
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_the_engine_records_the_routing_the_learner_replays(engines, family):
    """Each generation comes with the experts of every token the engine fed (prompt in the prefill, sampled tokens in
    the decode steps; none for the last sampled token); they are the learner's own choices on the sequence, and
    replayed they give the engine's logprobs."""
    model = _model(family)
    engine = engines[family]
    engine.model = model
    prompts = [[5, 9, 2, 7], [5, 9, 2, 7], [11, 3, 8, 1, 4, 6]]
    out = engine.generate([_request(p, 10 + i, 12) for i, p in enumerate(prompts)])
    for prompt, tokens, logprobs, routes in zip(prompts, out.tokens, out.logprobs, out.routes, strict=True):
        seq = np.asarray([prompt + tokens])
        assert routes.shape == (seq.shape[1], LAYERS * K) and routes.dtype == np.int16
        assert (routes[-1] == moe.NO_EXPERT).all() and (routes[:-1] >= 0).all()
        own = _own_routing(model, seq)[0]
        np.testing.assert_array_equal(
            np.sort(routes[:-1].reshape(-1, LAYERS, K), -1), np.sort(own[:-1].reshape(-1, LAYERS, K), -1)
        )
        replayed = _logprobs(model, seq, routes[None])[0, len(prompt) - 1 :]
        assert np.abs(replayed - np.asarray(logprobs)).max() < 1e-4


def test_replay_gives_back_the_samplers_logprobs_where_a_perturbed_router_would_route_otherwise(engines):
    """The mismatch routing replay removes, made deterministic: the sampler's router and the learner's differ by a
    tiny perturbation (as bfloat16 or another kernel would make them), on a router with near-ties. Without replay,
    tokens whose routing flips disagree by far more than the perturbation; routed by the sampler's record, the learner
    agrees with the sampler to the perturbation's own size."""
    sampler_model = _model("qwen3_moe", router_scale=0.02)
    noise = jax.random.normal(jax.random.PRNGKey(7), _gate(sampler_model).array.shape) * 1e-3
    learner_model = eqx.tree_at(lambda m: _gate(m).array, sampler_model, _gate(sampler_model).array + noise)
    engine = engines["qwen3_moe"]
    engine.model = sampler_model
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(0, VOCAB, 6)) for _ in range(8)]
    out = engine.generate([_request(p, 50 + i, 24) for i, p in enumerate(prompts)])
    seqs = np.asarray([p + t for p, t in zip(prompts, out.tokens, strict=True)])
    routes = np.stack(out.routes)
    sampler_lp = np.asarray(out.logprobs)
    flips = (np.sort(_own_routing(learner_model, seqs)[:, :-1], -1) != np.sort(routes[:, :-1], -1)).any(-1).mean()
    free = np.abs(_logprobs(learner_model, seqs)[:, 5:] - sampler_lp)
    replayed = np.abs(_logprobs(learner_model, seqs, routes)[:, 5:] - sampler_lp)
    print(f"REPLAY flipped tokens {flips:.3f} max|dlogprob| free {free.max():.2e} replayed {replayed.max():.2e}")
    assert flips > 0.01, "the perturbation flipped no routing: the test shows nothing"
    assert free.max() > 10 * replayed.max()
    assert replayed.max() < 0.05


def test_the_wire_form_round_trips_and_names_what_is_malformed():
    routes = np.asarray([[0, 3, 7, -1], [2, 2, 1, 0], [-1, -1, -1, -1]], np.int16)
    payload = encode_routes(routes)
    assert payload["shape"] == [3, 4] and payload["dtype"] == "int16"
    np.testing.assert_array_equal(decode_routes(payload, 3), routes)
    with pytest.raises(ValueError, match="covers 3 tokens, but the prompt and completion have 4"):
        decode_routes(payload, 4)
    with pytest.raises(ValueError, match="holds 22 bytes for shape"):
        decode_routes({**payload, "data": base64.b64encode(b"x" * 22).decode()}, 3)
    with pytest.raises(ValueError, match="routed_experts must be"):
        decode_routes([1, 2], 3)


def test_routes_travel_from_the_server_through_the_turns_and_the_store_to_the_packed_batch(tmp_path):
    """The embedded server answers `return_routed_experts` requests (HTTP and in process) with each choice's routing;
    an environment's turns carry it (the prompt's on the prompt turn), the Parquet store keeps it as int16 lists, and
    packing puts it in the batch's `routed_experts`, -1 on padding."""
    from marin_rl.envs.arithmetic import AdditionEnvironment
    from marin_rl.envs.base import SamplingParams
    from marin_rl.inference.client import PolicyClient
    from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
    from marin_rl.inference.levanter_server import LevanterInferenceServer
    from marin_rl.inference.local_client import InProcessPolicyClient
    from marin_rl.replay.packing import Sequence, pack
    from marin_rl.replay.store import RolloutWriter, read_rollouts
    from marin_rl.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_model(ModelConfig(architecture=_architecture("qwen3_moe")), len(tok))
    config = InferenceConfig(
        max_seqs=8, max_seq_len=64, levanter=LevanterServerConfig(engine="dense", record_routing=True)
    )
    server = LevanterInferenceServer(model, tok, config)
    server.apply_weights(0, [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))])
    address = server.start()
    try:

        async def sample():
            http = PolicyClient([address], routed_experts=True)
            plain = PolicyClient([address])
            local = InProcessPolicyClient(server, routed_experts=True)
            prompt = [5, 6, 7, 8]
            out = [
                await http.sample(prompt, n=2, max_tokens=6, seed=3),
                await plain.sample(prompt, n=1, max_tokens=6, seed=3),
                await local.sample(prompt, n=2, max_tokens=6, seed=3),
            ]
            await http.aclose()
            await plain.aclose()
            return out

        over_http, plain, in_process = asyncio.run(sample())
        assert plain[0].routed_experts is None
        for a, b in zip(over_http, in_process, strict=True):
            assert a.token_ids == b.token_ids
            assert a.routed_experts.shape == (4 + len(a.token_ids), LAYERS * K)
            np.testing.assert_array_equal(a.routed_experts, b.routed_experts)

        env = AdditionEnvironment(tok, max_operand=9, num_eval=4)
        sampling = SamplingParams(temperature=1.0, max_tokens=4)

        async def episodes():
            client = InProcessPolicyClient(server, routed_experts=True)
            return await asyncio.gather(*(env.run_group(client, p, 2, sampling) for p in env.train_problems()[:2]))

        groups = asyncio.run(episodes())
    finally:
        server.stop()
    rollouts = [r for g in groups for r in g.rollouts]
    for r in rollouts:
        r.validate(len(tok))
        routes = r.routed_experts()
        assert routes.shape == (r.num_tokens, LAYERS * K)
        prompt, sampled = r.turns
        assert len(prompt.routed_experts) == len(prompt.token_ids) and (np.asarray(prompt.routed_experts) >= 0).all()
        assert sampled.routed_experts[-1] == [moe.NO_EXPERT] * (LAYERS * K)
    writer = RolloutWriter(str(tmp_path / "rollouts"))
    for g in groups:
        writer.append_rollouts(g.rollouts, g.group_id, [0.0] * len(g.rollouts), accepted_at=1.0)
    writer.close()
    back = [stored.rollout for stored in read_rollouts(str(tmp_path / "rollouts")).rollouts]
    assert len(back) == len(rollouts)
    for a, b in zip(rollouts, back, strict=True):
        np.testing.assert_array_equal(a.routed_experts(), b.routed_experts())
    seqs = [Sequence.from_rollout(r, 1.0) for r in back]
    batch, placed = pack(seqs, 2, 32)
    assert len(placed) == len(seqs)
    assert batch.routed_experts.shape == (2, 32, LAYERS * K) and batch.routed_experts.dtype == np.int16
    assert (batch.routed_experts[batch.segment_ids < 0] == -1).all()


def test_a_bad_turn_record_is_refused_naming_the_field():
    from marin_rl.types import InferenceMetadata, Rollout, RolloutFormatError, Turn

    meta = InferenceMetadata(server="s", version_start=0, version_end=0)
    sampled = Turn("assistant", "", [4, 5], sampler_logprobs=[-1.0, -1.0], inference_metadata=meta)
    rollout = Rollout("e", "p", [Turn("user", "", [1, 2, 3], routed_experts=[[0, 1]] * 3), sampled])
    rollout.validate()
    sampled.routed_experts = [[0, 1]]  # one row for two tokens
    with pytest.raises(RolloutFormatError, match=r"routed experts must be \[2 tokens, 2\] integers") as info:
        rollout.validate()
    assert info.value.reason == "routed_experts"
    sampled.routed_experts = [[0, -2], [1, 1]]
    with pytest.raises(RolloutFormatError, match=r"in \[-1, 32767\]"):
        rollout.validate()


def test_routing_replay_is_refused_without_an_expert_model_or_a_recording_engine():
    from marin_rl.config import parse_config

    base = ["--config", "experiments/quickstart_moe.yaml"]
    with pytest.raises(SystemExit, match="learner.moe.routing_replay: only the embedded server's dense engine"):
        parse_config([*base, "--inference.backend", "vllm"])
    with pytest.raises(SystemExit, match="learner.moe.routing_replay: LlamaConfig has no expert layers"):
        parse_config(["--config", "experiments/quickstart_local.yaml", "--learner.moe.routing_replay", "true"])
    resolved = parse_config(base)
    assert resolved.learner.moe.routing_replay and resolved.inference.levanter.record_routing, "derived from it"


def test_a_learner_step_trains_with_replayed_routing_and_refuses_a_batch_without_it():
    """With `learner.moe.routing_replay` the learner's logprobs follow the batch's record: a record of the model's
    own routing gives the unreplayed logprobs, another record other ones; a step trains; a batch without a record is
    refused by name."""
    from test_hf_families import _packed

    from marin_rl.learner.config import LearnerConfig, MoeConfig
    from marin_rl.learner.learner import Learner

    learner = Learner(
        ModelConfig(architecture=_architecture("qwen3_moe")), LearnerConfig(moe=MoeConfig(routing_replay=True)), VOCAB
    )
    seqs = np.random.default_rng(2).integers(0, VOCAB, (2, 16)).astype(np.int32)
    batch = dataclasses.replace(_packed(seqs), routed_experts=_own_routing(learner.model, seqs).astype(np.int16))
    mask = batch.loss_mask
    with jax.default_matmul_precision("highest"):
        own = learner.logprobs(batch)
        other = learner.logprobs(dataclasses.replace(batch, routed_experts=(batch.routed_experts + 3) % 8))
        np.testing.assert_allclose(own[:, 1:], _logprobs(learner.model, seqs), atol=1e-5)
        assert np.abs(other - own).max() > 1e-2
        metrics = learner.train_step(dataclasses.replace(batch, sampler_logprobs=np.where(mask, own, 0)))
    assert np.isfinite(metrics["learner/loss"])
    with pytest.raises(ValueError, match="the batch carries no routed experts"):
        learner.logprobs(dataclasses.replace(batch, routed_experts=None))


@pytest.mark.slow
def test_the_moe_quickstart_learns_with_routing_replay(tmp_path):
    """experiments/quickstart_moe.yaml as shipped (a tiny Qwen3-MoE, routing replay on, 300 RL steps, local backend):
    the held-out reward rises by >= 0.3, and the stored rollouts carry the sampler's routing of every token but each
    sampled turn's last."""
    import json
    import subprocess
    import sys

    from test_local_backend import ROOT, _finish, _without_ray

    from marin_rl.replay.store import read_rollouts

    out, log = tmp_path / "run", tmp_path / "run.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "marin_rl.run", "--config", str(ROOT / "experiments" / "quickstart_moe.yaml")]
        + ["--output_dir", str(out)],
        cwd=ROOT,
        env=_without_ray(tmp_path),
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    _finish(proc, log, 1500)
    summary = json.loads((out / "summary.json").read_text())
    gain = summary["eval_reward_end"] - summary["eval_reward_start"]
    print(f"MOE QUICKSTART {summary['eval_reward_start']:.3f} -> {summary['eval_reward_end']:.3f} (+{gain:.3f})")
    assert gain >= 0.3, f"held-out reward {summary['eval_reward_start']:.3f} -> {summary['eval_reward_end']:.3f}"
    stored = read_rollouts(str(out / "rollouts")).rollouts
    assert stored
    for s in stored[:50]:
        routes = s.rollout.routed_experts()
        assert routes is not None and routes.shape == (s.rollout.num_tokens, LAYERS * K)
        assert (routes >= 0).sum(-1).astype(bool).sum() == s.rollout.num_tokens - 1  # all but the last token's


def test_a_later_prompt_fills_the_routing_the_earlier_turns_lack():
    """A multi-turn conversation: each request's prompt is every turn so far, and its routing fills what the turns
    lack (the environment's turn; the previous policy turn's last token, never fed before), keeping what they have."""
    from marin_rl.envs.base import SamplingParams, add_prompt_routing, policy_turn
    from marin_rl.inference.client import Sample

    def sample(prompt_len: int, tokens: list[int], first: int) -> Sample:
        routes = np.arange(first, first + prompt_len + len(tokens)).repeat(2).reshape(-1, 2).astype(np.int16)
        routes[-1] = moe.NO_EXPERT
        return Sample(tokens, [-1.0] * len(tokens), "", "stop", 0, 0, "s", 0.0, routed_experts=routes)

    sampling = SamplingParams(temperature=1.0, max_tokens=4)
    from marin_rl.types import Turn

    turns = [Turn("user", "", [1, 2, 3])]
    first = sample(3, [4, 5], 0)
    add_prompt_routing(turns, first)
    turns.append(policy_turn(first, "", sampling))
    assert turns[0].routed_experts == [[0, 0], [1, 1], [2, 2]]
    assert turns[1].routed_experts == [[3, 3], [-1, -1]]
    turns.append(Turn("tool", "", [6, 7]))
    second = sample(7, [8], 100)  # the prompt: the five tokens so far and the tool's two
    add_prompt_routing(turns, second)
    assert turns[0].routed_experts == [[0, 0], [1, 1], [2, 2]], "recorded routing stands"
    assert turns[1].routed_experts == [[3, 3], [104, 104]], "the last token's, first fed in the second prompt"
    assert turns[2].routed_experts == [[105, 105], [106, 106]]
    with pytest.raises(ValueError, match="covers a prompt of 6 tokens, the turns before it hold 7"):
        add_prompt_routing(turns, sample(6, [9], 0))
