"""Expert parallelism (`learner.mesh.expert`): tiny Qwen3-MoE and Mixtral models on an `expert=4` mesh (4 of 8
simulated CPU devices) and a `data=2 × expert=4` mesh (all 8) compute the RL loss and its gradients of one learner
step as one device does, with their experts' weights split over the `expert` axis; the dense engine samples from
those split weights as from whole ones; bad expert configs are refused with one clear error.

As in tests/test_sharding.py, the sharded runs happen in one subprocess started with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (JAX fixes its CPU device count when it starts).
"""

import json

import numpy as np
import pytest
import yaml
from subprocess_env import run_on_cpu_devices

from marin_rl.config import RunConfig, parse_config
from marin_rl.learner.config import EXPERTS, MESH_AXES, LearnerConfig, MeshConfig
from marin_rl.model.config import tiny_llama

MESHES = {"one": {"data": 1}, "ep4": {"data": 1, "expert": 4}, "dp2_ep4": {"data": 2, "expert": 4}}
"""The reference (one device) and the expert-parallel meshes, by name."""
FAMILIES = ("qwen3_moe", "mixtral")
ATOL = 1e-5
"""Largest |difference| allowed between a sharded run's loss or gradient element and one device's (float32)."""

WORKER = r"""
import json, sys
import equinox as eqx
import jax
import numpy as np
import optax
from levanter.models.mixtral import MixtralConfig
from levanter.models.qwen3_moe import Qwen3MoeConfig
from marin_rl.inference.dense_engine import DenseEngine
from marin_rl.inference.levanter_server import _FullDistributionSampler
from marin_rl.learner.config import LearnerConfig, LossConfig, MeshConfig
from marin_rl.learner.learner import Learner
from marin_rl.model.config import ModelConfig
from random_packed_batch import random_packed_batch
from test_dense_engine import _request

out_dir, meshes, families = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
assert jax.device_count() == 8, jax.devices()
ROWS, SEQ, VOCAB = 8, 32, 64
common = dict(max_seq_len=SEQ, hidden_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, gradient_checkpointing=False,
              scan_layers=True, tie_word_embeddings=False)
architectures = {  # 8 experts, top 2: two experts per device on the expert axis
    "qwen3_moe": Qwen3MoeConfig(intermediate_dim=64, moe_intermediate_dim=16, head_dim=8, num_experts=8,
                                num_experts_per_tok=2, **common),
    "mixtral": MixtralConfig(intermediate_dim=16, n_routed_experts=8, num_experts_per_tok=2, **common),
}
batch = random_packed_batch(0, ROWS, SEQ, VOCAB, segments=2)
prompt = [int(t) for t in batch.input_ids[0, :6]]


def sample(learner):
    # greedy from the dense engine on the learner's own (for a mesh: expert-split) arrays
    engine = DenseEngine(learner.model, _FullDistributionSampler(learner.model.Vocab), max_seqs=2, max_seq_len=SEQ,
                         max_stop_seqs=1, max_stop_tokens=1)
    result = engine.generate([_request(prompt, 0, 6, temperature=0.0)])
    return {"tokens": [int(t) for t in result.tokens[0]], "logprobs": [float(x) for x in result.logprobs[0]]}


for family in families:
    for name, mesh in meshes.items():
        cfg = LearnerConfig(loss=LossConfig(objective="ppo"), mesh=MeshConfig(**mesh))
        learner = Learner(ModelConfig(architecture=architectures[family]), cfg, VOCAB)
        # plain SGD with step 1: the step moves the parameters by exactly minus the gradient
        learner.optimizer = optax.sgd(1.0)
        learner.opt_state = learner.supervised_optimizer_state(learner.optimizer)
        before = [np.asarray(w) for w in jax.tree_util.tree_leaves(eqx.filter(learner.model, eqx.is_array))]
        info = {"mesh": None if learner.mesh is None else dict(learner.mesh.shape)}
        if family == "qwen3_moe" and name != "ep4":
            info["sample"] = sample(learner)
        step = learner.train_step(batch)  # one learner step: its loss, gradient norm and gradients
        info.update(loss=step["learner/loss"], grad_norm=step["learner/grad_norm"])
        after = [np.asarray(w) for w in jax.tree_util.tree_leaves(eqx.filter(learner.model, eqx.is_array))]
        stacked = learner.model.transformer.layers.stacked
        block = stacked.block_sparse_moe if family == "mixtral" else stacked.mlp
        info["experts"] = {}  # every array of the trained sparse block (each has an experts axis): how it is split
        for path, leaf in jax.tree_util.tree_leaves_with_path(eqx.filter(block, eqx.is_array)):
            info["experts"][jax.tree_util.keystr(path)] = {
                "spec": [s if s is None or isinstance(s, str) else list(s) for s in leaf.sharding.spec],
                "devices": len(leaf.sharding.device_set), "shape": list(leaf.shape),
                "shard_shape": list(leaf.sharding.shard_shape(leaf.shape)),
            }
        np.savez(f"{out_dir}/{family}_{name}_init.npz", *before)
        np.savez(f"{out_dir}/{family}_{name}.npz", *[b - a for b, a in zip(before, after)])
        with open(f"{out_dir}/{family}_{name}.json", "w") as f:
            json.dump(info, f)
print("done")
"""


@pytest.fixture(
    scope="module",
    # Mixtral's runs in the end-to-end tier (the gate keeps one family: ~45 s a family on two cores)
    params=[pytest.param(f, marks=pytest.mark.slow) if f == "mixtral" else f for f in FAMILIES],
)
def runs(request, tmp_path_factory):
    """One family's runs on every mesh of `MESHES` (one subprocess per family): name → what the worker saved."""
    family = request.param
    out = tmp_path_factory.mktemp(f"expert_parallel_{family}")
    run_on_cpu_devices(WORKER, str(out), json.dumps(MESHES), json.dumps([family]))
    results = {}
    for name in MESHES:
        with open(out / f"{family}_{name}.json") as f:
            info = json.load(f)
        for key, file in (("grads", f"{family}_{name}.npz"), ("initial", f"{family}_{name}_init.npz")):
            with np.load(out / file) as z:
                info[key] = [z[f"arr_{i}"] for i in range(len(z.files))]
        results[name] = info
    return results


@pytest.mark.parametrize("name", ["ep4", "dp2_ep4"])
def test_expert_parallel_loss_and_gradients_match_one_device(runs, name):
    ref, got = runs["one"], runs[name]
    assert ref["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}  # an expert model runs under a one-device mesh
    assert got["mesh"] == {"data": MESHES[name]["data"], "expert": 4, "fsdp": 1, "tensor": 1}
    for key in ("loss", "grad_norm"):
        assert abs(got[key] - ref[key]) <= ATOL, (key, got[key], ref[key])
    for w_ref, w_got in zip(ref["initial"], got["initial"], strict=True):
        np.testing.assert_array_equal(w_got, w_ref)
    assert len(got["grads"]) == len(ref["grads"]) and max(float(np.abs(g).max()) for g in ref["grads"]) > 0.1
    worst = max(float(np.max(np.abs(g - r))) for g, r in zip(got["grads"], ref["grads"], strict=True))
    assert worst <= ATOL, worst


def test_expert_weights_are_split_over_the_expert_axis(runs):
    for name in MESHES:
        arrays = runs[name]["experts"]
        assert len(arrays) == 4, arrays  # the router and the three expert projections: each has the experts axis
        for path, a in arrays.items():
            # (layer, experts, ...): the experts axis second
            assert a["shape"][1] == 8, (path, a)
            if name == "one":
                assert a["devices"] == 1 and a["shard_shape"] == a["shape"]
            else:
                assert a["spec"][:2] == [None, "expert"], (name, path, a)
                assert a["shard_shape"] == [a["shape"][0], 2, *a["shape"][2:]], (name, path, a)
                assert a["devices"] == 4 * MESHES[name]["data"]


@pytest.mark.parametrize("runs", ["qwen3_moe"], indirect=True)
def test_the_dense_engine_samples_from_expert_split_weights(runs):
    ref, got = runs["one"]["sample"], runs["dp2_ep4"]["sample"]
    assert len(ref["tokens"]) == 6 and got["tokens"] == ref["tokens"]
    np.testing.assert_allclose(got["logprobs"], ref["logprobs"], atol=ATOL)


def test_the_experts_axis_is_levanters():
    from levanter.models.mixtral import MixtralConfig
    from levanter.models.qwen3_moe import Qwen3MoeConfig

    assert Qwen3MoeConfig().Experts.name == MixtralConfig().Experts.name == EXPERTS


def test_expert_one_is_the_three_axis_mesh():
    default = MeshConfig()
    assert default.axes == MESH_AXES and default.shape(8) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert default.compute_axis_mapping["batch"] == ("data", "fsdp")
    assert EXPERTS not in default.param_axis_mapping  # no expert axis to split them over
    ep = MeshConfig(expert=4)
    assert ep.axes == ("data", "expert", "fsdp", "tensor")
    assert ep.shape(8) == {"data": 2, "expert": 4, "fsdp": 1, "tensor": 1}
    assert ep.compute_axis_mapping["batch"] == ("data", "expert", "fsdp")
    assert ep.param_axis_mapping[EXPERTS] == "expert" and EXPERTS not in ep.compute_axis_mapping


def test_bad_expert_configs_are_refused_naming_the_field():
    from levanter.models.qwen3_moe import Qwen3MoeConfig

    moe = Qwen3MoeConfig(num_experts=8, num_experts_per_tok=2)
    MeshConfig(expert=4).check_model(moe)
    MeshConfig().check_model(tiny_llama())
    with pytest.raises(ValueError, match=r"learner\.mesh\.expert=2, but LlamaConfig has no mixture-of-experts"):
        MeshConfig(expert=2).check_model(tiny_llama())
    with pytest.raises(ValueError, match=r"learner\.mesh\.expert=3 does not divide the model's 8 experts"):
        MeshConfig(expert=3).check_model(moe)
    with pytest.raises(ValueError, match=r"learner\.mesh\.param_mapping\['experts'\] = None does not split"):
        MeshConfig(expert=2, param_mapping={"embed": "fsdp"}).check_model(moe)
    with pytest.raises(ValueError, match=r"learner\.mesh\.compute_mapping\['experts'\]"):
        MeshConfig(compute_mapping={"batch": "data", EXPERTS: "expert"})
    with pytest.raises(ValueError, match=r"learner\.mesh\.expert"):
        MeshConfig(expert=0)
    with pytest.raises(ValueError, match=r"expert=4 × fsdp=1 × tensor=1 = 4 does not divide the 6"):
        MeshConfig(expert=4).shape(6)
    with pytest.raises(ValueError, match=r"data=2 × expert=4 × fsdp=1 × tensor=1 = 8 devices, but only 4"):
        MeshConfig(data=2, expert=4).shape(4)
    # the whole run's config is checked before anything starts
    with pytest.raises(ValueError, match=r"learner\.mesh\.expert=2, but LlamaConfig"):
        RunConfig(learner=LearnerConfig(mesh=MeshConfig(expert=2))).validate()


def test_the_expert_field_parses_from_a_run_config(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"learner": {"mesh": {"expert": 2}}}))
    with pytest.raises(SystemExit, match=r"invalid configuration: learner\.mesh\.expert=2, but LlamaConfig"):
        parse_config(["--config", str(path)])
