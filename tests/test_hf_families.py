"""Real model families from Hugging Face checkpoints: the learner's per-token logprobs equal transformers' own, or
the checkpoint is refused with one line naming the setting Levanter cannot honour.

The checkpoints are tiny random models of each family's real shape (GQA, tying, qkv bias, qk-norm, soft-capping,
explicit head_dim, Llama 3 rotary scaling), saved by transformers 5.x, which also computed the reference logprobs
(`tests/hf_reference.py`). Their tensors are drawn from a seed, so the repository ships only their configs and those
logprobs (`tests/data/hf_families/`, `tests/seeded_checkpoints.py`) and every run of the suite checks them without
torch; the end-to-end tier checks that the shipped references are still what transformers computes. A 4.x-layout
copy of each config.json (top-level `rope_theta` and `rope_scaling`) must load to the same numbers.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from levanter.layers.attention import AttentionMask
from levanter.models.llama import LlamaConfig
from reference_python import built_vllm_python, reference_python
from seeded_checkpoints import DATA, materialise

from marin_rl.model.build import build_model
from marin_rl.model.config import ModelConfig
from marin_rl.model.hf_config import architecture_from_hf, normalised_hf_config, unhonoured_setting

TOLERANCE = 1e-4

SHIPPED = DATA / "hf_families"
"""The shipped references: each case's config files and list of tensors, and transformers' logprobs."""

LOADED = (
    "llama3",
    "llama_tied",
    "llama_yarn",
    "qwen2",
    "qwen3",
    "olmo2",
    "mistral",
    "mistral_window_4096",
    "gemma2",
    "gemma3",
    "qwen3_moe",
    "mixtral",
)
"""Cases that must load and agree with transformers."""

# The mixture-of-experts tests below run Mixtral in the end-to-end tier: the gate keeps Qwen3-MoE, and Mixtral's
# engine parity in the matrix (`test_each_engine_samples_what_the_learner_scores_or_refuses_the_family_by_name`).

REFUSED = {
    "llama_dynamic": "rope_type: 'dynamic' is not supported",
    "mistral_window_8": "sliding_window: 8 tokens is shorter than the context of 128 positions",
    "mistral_head_dim": "head_dim: Levanter's MistralConfig cannot represent 64",
    "gemma2_release": "final_logit_softcapping: 30.0 is not applied",
    "gemma3_release": "rope_local_base_freq: 10000.0 on the sliding layers differs from rope_theta 1000000.0",
}
"""Cases that must be refused, and the start of what the one-line error names."""


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> tuple[Path, dict]:
    """The shipped checkpoints, written out once per test session, and transformers' logprobs on them."""
    out = tmp_path_factory.mktemp("hf_families")
    for case in sorted(p for p in SHIPPED.iterdir() if p.is_dir()):
        materialise(case, out / case.name, case.name)
    shutil.copy(SHIPPED / "reference.json", out / "reference.json")
    ref = json.loads((out / "reference.json").read_text())
    assert ref["versions"]["transformers"].split(".")[0] >= "5", ref["versions"]
    return out, ref


def _as_4x_layout(src: Path, dst: Path) -> Path:
    """A copy of the checkpoint at `src` whose config.json has transformers 4.x's rotary layout."""
    shutil.copytree(src, dst)
    raw = json.loads((src / "config.json").read_text())
    params = raw.pop("rope_parameters")
    if "full_attention" in params:  # Gemma 3: a global and a local base
        raw["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        params = params["full_attention"]
    raw["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default":
        # 4.x files of the llama3 era spell the type both ways; the older key is "type".
        params["type"] = params.pop("rope_type")
        raw["rope_scaling"] = params
    if raw["model_type"] == "qwen3_moe":
        raw["num_experts"] = raw.pop("num_local_experts")
    raw["transformers_version"] = "4.57.0"
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    return dst


def _learner_logprobs(path: Path, sequences: np.ndarray, precision: str | None = None) -> np.ndarray:
    """Per-token logprobs of `sequences` from the learner's forward of the policy loaded from `path`, with float32
    matmuls at `precision` (None: JAX's default, which is TF32 on NVIDIA GPUs: ~5e-3 nats from transformers' float32
    on an H100, against ~4e-6 at 'highest'; CPUs compute in float32 either way)."""
    arch = architecture_from_hf(str(path))
    model = build_model(ModelConfig(architecture=arch, init_from_hf=str(path)), _vocab(path))
    axes = (hax.Axis("batch", sequences.shape[0]), hax.Axis("position", sequences.shape[1]))
    # Levanter routes experts in a shard_map, which needs a device mesh (the learner's, on several devices).
    with (
        hax.partitioning.set_mesh(Mesh(np.array(jax.devices()[:1]), ("data",))),
        jax.default_matmul_precision(precision),
    ):
        logits = model(hax.named(jnp.asarray(sequences), axes), attn_mask=AttentionMask.causal()).array
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    return np.take_along_axis(logp[:, :-1], sequences[:, 1:, None], axis=-1)[..., 0]


def _vocab(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize("layout", ["5.x", "4.x"])
@pytest.mark.parametrize("name", LOADED)
def test_family_logprobs_match_transformers(reference, tmp_path, name, layout):
    root, ref = reference
    path = root / name if layout == "5.x" else _as_4x_layout(root / name, tmp_path / name)
    want = np.asarray(ref["cases"][name]["logprobs"])
    got = _learner_logprobs(path, np.asarray(ref["sequences"]), precision="highest")  # the model's math, in float32
    assert got.shape == want.shape
    delta = float(np.abs(got - want).max())
    print(f"PARITY {name} {layout} max|dlogprob|={delta:.2e}")
    assert delta <= TOLERANCE, f"{name} ({layout} config.json): max |Δ logprob| {delta:.2e} > {TOLERANCE}"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unhonourable_settings_are_refused_naming_the_key(reference, name):
    root, _ = reference
    with pytest.raises(ValueError) as info:
        _learner_logprobs(root / name, np.zeros((1, 4), dtype=np.int64))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"model.init_from_hf='{root / name}': ")
    assert REFUSED[name] in message, message


def test_a_configured_rope_base_that_differs_is_refused(reference):
    """The silent failure this guards against: a Llama 3 checkpoint (rope_parameters.rope_theta 500000) loaded with
    a configured base of 10000 must be refused, naming rope_theta, in either config.json layout."""
    root, _ = reference
    path = root / "llama_tied"
    arch = architecture_from_hf(str(path))
    assert arch.rope.theta == 500000.0
    wrong = LlamaConfig(**{**arch.__dict__, "rope": type(arch.rope)(theta=10000.0)})
    with pytest.raises(ValueError, match=r"rope_theta: configured 10000.0 != checkpoint 500000.0"):
        build_model(ModelConfig(architecture=wrong, init_from_hf=str(path)), _vocab(path))


def test_layouts_that_disagree_are_refused():
    raw = {"model_type": "llama", "rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    with pytest.raises(ValueError, match="rope_theta: the top-level 10000.0 disagrees with rope_parameters' 500000.0"):
        normalised_hf_config(raw)


def test_qwen_moe_expert_count_is_read_in_either_layout():
    five = normalised_hf_config({"model_type": "qwen3_moe", "num_local_experts": 4})
    assert five["num_experts"] == 4 and "num_local_experts" not in five
    with pytest.raises(ValueError, match="num_experts: 8 disagrees with num_local_experts 4"):
        normalised_hf_config({"model_type": "qwen3_moe", "num_local_experts": 4, "num_experts": 8})


def test_a_setting_levanter_never_reads_is_refused(reference, tmp_path):
    """A 5.x key with no 4.x counterpart (here: a made-up one) is refused rather than dropped."""
    root, _ = reference
    path = tmp_path / "llama"
    shutil.copytree(root / "llama_tied", path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "attn_temperature_tuning": True}))
    with pytest.raises(ValueError, match="attn_temperature_tuning: True is not a setting of transformers 4.x's"):
        _learner_logprobs(path, np.zeros((1, 4), dtype=np.int64))


def test_normalised_layouts_agree():
    five = {
        "model_type": "llama",
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0},
    }
    four = {
        "model_type": "llama",
        "rope_theta": 5e5,
        "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
    }
    assert normalised_hf_config(five) == normalised_hf_config(four)
    assert normalised_hf_config(five)["rope_scaling"]["rope_type"] == "llama3"
    plain = normalised_hf_config(
        {"model_type": "qwen2", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    )
    assert plain["rope_theta"] == 1e6 and plain["rope_scaling"] is None and "rope_parameters" not in plain


@pytest.mark.parametrize(
    ("cfg", "key"),
    [
        ({"model_type": "llama", "rope_scaling": {"rope_type": "longrope"}}, "rope_type: 'longrope'"),
        (
            {"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0}},
            "rope_scaling.mscale_all_dim",
        ),
        (
            {"model_type": "mistral", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "rope_scaling: 'llama3' scaling is dropped",
        ),
        (
            {"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 2.0}},
            "rope_scaling.mscale",
        ),
        ({"model_type": "llama", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"model_type": "qwen2", "attention_bias": False}, "attention_bias: false"),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64}, "sliding_window: 64 tokens"),
        ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"model_type": "gemma2", "head_dim": 16, "query_pre_attn_scalar": 224}, "query_pre_attn_scalar: 224"),
    ],
)
def test_unhonoured_settings_name_their_key(cfg, key):
    assert key in (unhonoured_setting(cfg, 128) or "")


@pytest.mark.parametrize(
    "cfg",
    [
        {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 64},  # declared, not used
        {"model_type": "mistral", "sliding_window": 4096},  # longer than the context: no effect
        {"model_type": "gemma2", "attn_logit_softcapping": 50.0, "head_dim": 16, "query_pre_attn_scalar": 16},
        {"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}},
        {"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0}},  # as exported
    ],
)
def test_honoured_settings_pass(cfg):
    assert unhonoured_setting(cfg, 128) is None


ENGINES = {
    "dense": {
        "llama3",
        "llama_tied",
        "llama_yarn",
        "qwen2",
        "qwen3",
        "mistral",
        "mistral_window_4096",
        "qwen3_moe",
        "mixtral",
    },
    "paged": {"llama3", "llama_tied", "llama_yarn", "qwen3"},
}
"""The families each embedded engine decodes (among the loaded cases); it refuses the others at start, by name."""


def _engine(kind: str, model):
    """The embedded engine `kind` ('dense' or 'paged', Levanter's) over `model`, as the embedded server builds it."""
    from test_levanter_engine import _engine as paged_engine

    from marin_rl.inference.dense_engine import DenseEngine
    from marin_rl.inference.engine_support import check_paged_supported
    from marin_rl.inference.levanter_server import _FullDistributionSampler
    from marin_rl.tokenizer import build_char_tokenizer

    sampler = _FullDistributionSampler(model.Vocab)
    if kind == "dense":
        return DenseEngine(model, sampler, max_seqs=8, max_seq_len=64, max_stop_seqs=1, max_stop_tokens=1)
    check_paged_supported(model)
    engine = paged_engine(
        model, build_char_tokenizer(), max_seq_len=64, max_pages=32, max_stop_seqs=1, max_stop_tokens=1
    )
    engine.sampler = sampler
    return engine


@pytest.mark.parametrize("kind", sorted(ENGINES))
@pytest.mark.parametrize("name", LOADED)
def test_each_engine_samples_what_the_learner_scores_or_refuses_the_family_by_name(reference, name, kind):
    """An embedded engine that decodes the family reports, for each token it samples, the logprob the learner's
    forward gives the sampled sequence (itself equal to transformers'); one that cannot is refused at start with one
    line naming the model class and the engines that can."""
    from test_dense_engine import _request
    from test_levanter_engine import _generate as paged_generate

    root, ref = reference
    path = root / name
    model = build_model(ModelConfig(architecture=architecture_from_hf(str(path)), init_from_hf=str(path)), _vocab(path))
    if name not in ENGINES[kind]:
        with pytest.raises(ValueError) as info:
            _engine(kind, model)
        message = str(info.value)
        assert "\n" not in message and type(model).__name__ in message, message
        assert "inference.backend: vllm" in message, message
        assert kind == "dense" or "inference.levanter.engine: dense" in message, message
        return
    engine = _engine(kind, model)
    prompts = np.asarray(ref["sequences"])[:, :8]
    requests = [_request(list(p), 10 + i, 6, rid=i) for i, p in enumerate(prompts)]
    out = engine.generate(requests) if kind == "dense" else paged_generate(engine, requests)
    assert all(len(t) == 6 for t in out.tokens)
    sequences = np.concatenate([prompts, np.asarray(out.tokens)], axis=1)
    want = _learner_logprobs(path, sequences)[:, 7:]  # the logprob of token t+1 given the tokens up to t
    delta = float(np.abs(np.asarray(out.logprobs) - want).max())
    print(f"PARITY {kind} {name} max|dlogprob|={delta:.2e}")
    assert delta <= TOLERANCE, f"{name}: the {kind} engine's logprobs differ from the learner's by {delta:.2e}"


def _router_margins(path: Path, sequences: np.ndarray) -> np.ndarray:
    """Per layer and token of `sequences` (the learner's forward of the policy at `path`): how far the router's
    probability of its k-th chosen expert lies above the best expert it left out ([layer, batch, position]). Routing
    is top-k, so a computation whose hidden states differ by more than this could pick other experts."""
    from levanter.models.mixtral import MixtralDecoderLayer

    model = build_model(ModelConfig(architecture=architecture_from_hf(str(path)), init_from_hf=str(path)), _vocab(path))
    axes = (hax.Axis("batch", sequences.shape[0]), hax.Axis("position", sequences.shape[1]))
    margins = []
    with (
        hax.partitioning.set_mesh(Mesh(np.array(jax.devices()[:1]), ("data",))),
        jax.default_matmul_precision("highest"),
    ):
        x = model.embeddings.embed(hax.named(jnp.asarray(sequences), axes))
        for layer in model.transformer.layers.unstacked():
            h = x + layer.self_attn(x=layer.input_layernorm(x), mask=AttentionMask.causal(), key=None)
            block = layer.block_sparse_moe if isinstance(layer, MixtralDecoderLayer) else layer.mlp
            probs = jax.nn.softmax(block.gate(layer.post_attention_layernorm(h), key=None).array.astype(jnp.float32))
            top = jax.lax.top_k(probs, block.config.num_experts_per_tok + 1)[0]
            margins.append(np.asarray(top[..., -2] - top[..., -1]))
            out = layer(x, AttentionMask.causal(), key=None)
            x = out[0] if isinstance(out, tuple) else out
    return np.stack(margins)


@pytest.mark.parametrize("name", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_the_dense_engine_samples_mixture_of_experts_checkpoints_as_the_learner_scores_them(reference, name):
    """Longer generations than the matrix's: 8 sequences (3 prompts, shared by the groups that sample them) of 40
    sampled tokens each, so the decode steps route hundreds of tokens; every sampled token's logprob equals the
    learner's forward on the sampled sequence. Routing is discontinuous (top-k), so a near-tie that the engine and
    the learner broke differently would show as a large gap; the smallest top-k margin is printed to say how near."""
    from test_dense_engine import _request

    root, ref = reference
    path = root / name
    model = build_model(ModelConfig(architecture=architecture_from_hf(str(path)), init_from_hf=str(path)), _vocab(path))
    engine = _engine("dense", model)
    assert engine.mesh is not None
    prompts = np.asarray(ref["sequences"])[:, :8]
    requests = [_request(list(prompts[i % 3]), 100 + i, 40, rid=i) for i in range(8)]
    out = engine.generate(requests)
    assert all(len(t) == 40 for t in out.tokens)
    sequences = np.concatenate([prompts[np.arange(8) % 3], np.asarray(out.tokens)], axis=1)
    want = _learner_logprobs(path, sequences)[:, 7:]
    delta = float(np.abs(np.asarray(out.logprobs) - want).max())
    margin = float(_router_margins(path, sequences).min())
    print(f"PARITY dense {name} 320 tokens max|dlogprob|={delta:.2e} min top-k router margin={margin:.2e}")
    assert delta <= TOLERANCE, f"{name}: the dense engine's logprobs differ from the learner's by {delta:.2e}"


def _packed(seqs: np.ndarray, logprobs: np.ndarray | None = None):
    """A `PackedBatch` of whole sequences (one per row), every token after the first trained on; `logprobs` (the
    sampler's, or zeros) and advantages spread over -1..1 across the rows."""
    from marin_rl.types import PackedBatch

    positions = np.tile(np.arange(seqs.shape[1], dtype=np.int32), (seqs.shape[0], 1))
    mask = positions >= 1
    sampled = np.zeros(seqs.shape, np.float32) if logprobs is None else np.where(mask, logprobs, 0)
    return PackedBatch(
        input_ids=seqs.astype(np.int32),
        position_ids=positions,
        segment_ids=np.zeros_like(seqs, dtype=np.int32),
        loss_mask=mask,
        advantages=np.where(mask, np.linspace(-1, 1, seqs.shape[0])[:, None], 0).astype(np.float32),
        sampler_logprobs=sampled.astype(np.float32),
        token_versions=np.where(mask, 0, -1).astype(np.int32),
    )


@pytest.mark.parametrize("name", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_the_embedded_server_serves_a_mixture_of_experts_learner_on_the_dense_engine(reference, name):
    """The embedded server on the dense engine serves a learner's mixture-of-experts policy (arrays on the learner's
    one-device mesh, calls under the server's own mesh and axis mapping): each sampled token's logprob equals the
    learner's, before and after a train step, and the new weights are served without recompiling."""
    import asyncio

    from marin_rl.inference.client import PolicyClient
    from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
    from marin_rl.inference.levanter_server import LevanterInferenceServer
    from marin_rl.learner.config import LearnerConfig
    from marin_rl.learner.learner import Learner
    from marin_rl.tokenizer import build_char_tokenizer

    root, ref = reference
    path = root / name
    learner = Learner(
        ModelConfig(architecture=architecture_from_hf(str(path)), init_from_hf=str(path)), LearnerConfig(), _vocab(path)
    )
    config = InferenceConfig(max_seqs=8, max_seq_len=64, levanter=LevanterServerConfig(engine="dense"))
    server = LevanterInferenceServer(learner.model, build_char_tokenizer(), config)
    address = server.start()
    prompt = [int(t) for t in ref["sequences"][0][:8]]

    def sample_and_score(version: int) -> np.ndarray:
        async def sample():
            client = PolicyClient([address], timeout_s=120)
            out = await client.sample(prompt, n=4, max_tokens=12, seed=5)
            await client.aclose()
            return out

        samples = asyncio.run(sample())
        assert all(len(s.token_ids) == 12 and s.version_start == s.version_end == version for s in samples)
        seqs = np.asarray([prompt + s.token_ids for s in samples])
        with jax.default_matmul_precision("highest"):
            want = learner.logprobs(_packed(seqs))[:, 8:]
        delta = float(np.abs(np.asarray([s.sampler_logprobs for s in samples]) - want).max())
        print(f"PARITY server dense {name} version {version} max|dlogprob|={delta:.2e}")
        assert delta <= TOLERANCE, f"{name}: served logprobs differ from the learner's by {delta:.2e}"
        return seqs

    try:
        server.apply_weights(0, learner.weights())
        seqs = sample_and_score(0)
        compiled = server.context.engine.compiled_programs()
        with jax.default_matmul_precision("highest"):
            assert np.isfinite(learner.train_step(_packed(seqs, learner.logprobs(_packed(seqs))))["learner/loss"])
        server.apply_weights(1, learner.weights())
        sample_and_score(1)
        assert server.context.engine.compiled_programs() == compiled, "new weights recompiled"
    finally:
        server.stop()


@pytest.mark.parametrize("name", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_the_learner_scores_and_trains_mixture_of_experts_checkpoints_on_one_device(reference, name):
    """Levanter routes experts in a shard_map, which needs a device mesh: on one device the learner builds a
    one-device mesh for such a model (others run without one). Its logprobs equal transformers' and a step trains."""
    from marin_rl.learner.config import LearnerConfig
    from marin_rl.learner.learner import Learner
    from marin_rl.types import PackedBatch

    root, ref = reference
    path = root / name
    config = ModelConfig(architecture=architecture_from_hf(str(path)), init_from_hf=str(path))
    learner = Learner(config, LearnerConfig(), _vocab(path))
    assert learner.mesh is not None
    seqs = np.asarray(ref["sequences"], dtype=np.int32)
    positions = np.tile(np.arange(seqs.shape[1], dtype=np.int32), (seqs.shape[0], 1))
    mask = positions >= 1
    batch = PackedBatch(
        input_ids=seqs,
        position_ids=positions,
        segment_ids=np.zeros_like(seqs),
        loss_mask=mask,
        advantages=np.where(mask, np.linspace(-1, 1, seqs.shape[0])[:, None], 0).astype(np.float32),
        sampler_logprobs=np.zeros(seqs.shape, np.float32),
        token_versions=np.where(mask, 0, -1).astype(np.int32),
    )
    with jax.default_matmul_precision("highest"):
        logprobs = learner.logprobs(batch)
    delta = float(np.abs(logprobs[:, 1:] - np.asarray(ref["cases"][name]["logprobs"])).max())
    print(f"PARITY learner {name} max|dlogprob|={delta:.2e}")
    assert delta <= TOLERANCE, f"{name}: the learner's logprobs differ from transformers' by {delta:.2e}"
    before = [np.asarray(x) for x in jax.tree_util.tree_leaves(learner.model)]
    on_policy = dataclasses.replace(batch, sampler_logprobs=np.where(mask, logprobs, 0).astype(np.float32))
    assert np.isfinite(learner.train_step(on_policy)["learner/loss"])
    after = [np.asarray(x) for x in jax.tree_util.tree_leaves(learner.model)]
    assert any(not np.array_equal(b, a) for b, a in zip(before, after, strict=True)), "the step changed nothing"


@pytest.mark.parametrize("name", LOADED)
def test_export_round_trips_every_tensor_bit_exactly(reference, tmp_path, name):
    """A checkpoint loaded and exported again holds the same tensors, bit for bit, under the same names, and its
    config.json describes the same architecture."""
    from safetensors.numpy import load_file

    from marin_rl.model.hf import export_hf_checkpoint
    from marin_rl.tokenizer import build_char_tokenizer

    root, _ = reference
    path = root / name
    arch = architecture_from_hf(str(path))
    model = build_model(ModelConfig(architecture=arch, init_from_hf=str(path)), _vocab(path))
    export_hf_checkpoint(model, build_char_tokenizer(), str(tmp_path))

    def tensors(directory: Path) -> dict[str, np.ndarray]:
        out = {}
        for f in sorted(directory.glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    original, exported = tensors(path), tensors(tmp_path)
    assert sorted(exported) == sorted(original), set(exported) ^ set(original)
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and exported[key].shape == value.shape, key
        assert np.array_equal(exported[key].view(np.uint8), value.view(np.uint8)), f"{name}: {key} differs"
    # Levanter writes no head_dim where it equals hidden / heads (Mistral): compare the heads it builds instead
    again = architecture_from_hf(str(tmp_path))
    if getattr(again, "head_dim", 0) is None and arch.head_dim == arch.hidden_dim // arch.num_heads:
        again = dataclasses.replace(again, head_dim=arch.head_dim)
    assert again == arch


def _vllm_scores_every_family_as_transformers_does(reference, python: str) -> None:
    root, ref = reference
    script = Path(__file__).with_name("vllm_family_logprobs.py")
    done = subprocess.run(
        [python, str(script), str(root), ",".join(LOADED)], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for name in LOADED:
        assert "error" not in got[name], f"{name}: vLLM failed: {got[name]['error']}"
        delta = float(np.abs(np.asarray(got[name]["logprobs"]) - np.asarray(ref["cases"][name]["logprobs"])).max())
        print(f"PARITY vllm {name} max|dlogprob|={delta:.2e}")
        assert delta <= TOLERANCE, f"{name}: vLLM's logprobs differ from transformers' by {delta:.2e}"


@pytest.mark.gate_run
def test_vllm_scores_every_family_as_transformers_does_where_its_environment_is_built(reference):
    """vLLM (its CPU build, float32, in the vLLM environment) gives each checkpoint's tokens the logprobs
    transformers gives them: the vLLM column of the parity matrix, in the gate where vLLM's environment exists."""
    _vllm_scores_every_family_as_transformers_does(reference, built_vllm_python())


@pytest.mark.slow
def test_vllm_scores_every_family_as_transformers_does(reference):
    """The same check in the end-to-end tier, which builds vLLM's environment where it is missing (minutes)."""
    _vllm_scores_every_family_as_transformers_does(reference, reference_python("vllm"))


@pytest.mark.slow
def test_the_shipped_references_are_what_transformers_computes(reference, tmp_path):
    """transformers >= 5, run now, writes the shipped checkpoints bit for bit (configs and tensors) and gives them the
    shipped logprobs: the fixtures the suite checks every family against have not drifted from their source."""
    root, ref = reference
    python = reference_python()
    script = Path(__file__).with_name("hf_reference.py")
    done = subprocess.run([python, str(script), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    fresh = json.loads((tmp_path / "reference.json").read_text())
    assert fresh["sequences"] == ref["sequences"] and sorted(fresh["cases"]) == sorted(ref["cases"])
    for name, case in ref["cases"].items():
        for f in sorted((root / name).iterdir()):
            again = tmp_path / name / f.name
            if f.suffix == ".json":  # as written by any transformers 5.x: the same settings
                ours, theirs = (json.loads(x.read_text()) for x in (f, again))
                ours.pop("transformers_version", None), theirs.pop("transformers_version", None)
                assert ours == theirs, f"{name}/{f.name} differs"
            else:
                assert f.read_bytes() == again.read_bytes(), f"{name}/{f.name} differs"
        if "logprobs" in case:
            delta = float(np.abs(np.asarray(fresh["cases"][name]["logprobs"]) - np.asarray(case["logprobs"])).max())
            assert delta <= 1e-6, f"{name}: transformers {fresh['versions']} now gives logprobs {delta:.2e} away"
