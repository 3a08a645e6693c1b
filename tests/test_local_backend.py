"""The local backend (`orchestrator.backend: local`): a whole run in one process without Ray, the engine sampling
from the learner's own weights. It learns where `import ray` fails, hands each version over without copying it,
answers exactly what the HTTP front end answers, resumes a SIGKILLed deterministic run exactly, and refuses what it
cannot run with one line."""

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from deterministic_run import deterministic_config, final_learner_arrays, warm_starts
from subprocess_env import subprocess_env
from test_resume import _markers, _progress, _reap_session, _signal_when, _stop_all

from marin_rl.envs.arithmetic import AdditionEnvironment
from marin_rl.inference.client import PolicyClient
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.inference.local_client import InProcessPolicyClient
from marin_rl.learner.config import LearnerConfig, WarmStartConfig
from marin_rl.learner.learner import Learner
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.orchestrator.local_backend.backend import policy_bytes
from marin_rl.run import parse_config
from marin_rl.tokenizer import build_char_tokenizer
from marin_rl.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def _without_ray(tmp_path: Path) -> dict[str, str]:
    """An environment in which `import ray` fails (a module of that name that raises comes first on the path)."""
    shim = tmp_path / "no_ray"
    shim.mkdir(exist_ok=True)
    (shim / "ray.py").write_text('raise ImportError("ray is not installed here")\n')
    return subprocess_env(shim, PYTHONUNBUFFERED="1")


def _start(config: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "marin_rl.run", "--config", str(config)],
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _finish(proc: subprocess.Popen, log: Path, timeout: float, expect_rc: int = 0) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        _reap_session(proc.pid)
    assert rc == expect_rc, f"run ended with rc={rc}, expected {expect_rc}:\n" + log.read_text()[-6000:]


# ---- the whole run ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_run_program_imports_where_ray_is_not_installed(tmp_path):
    """Every module `python -m marin_rl.run` imports loads without Ray (the local backend's promise); the end-to-end
    run below shows it too, this names the import that breaks it in seconds."""
    code = (
        "import marin_rl.run, marin_rl.orchestrator.local_backend.backend, marin_rl.orchestrator.local_backend.learner"
    )
    done = subprocess.run([sys.executable, "-c", code], env=_without_ray(tmp_path), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def _local_quickstart_learns(tmp_path, timeout_s: float, *overrides: str):
    """Run experiments/quickstart_local.yaml for 100 RL steps (with `overrides`) in a process where `import ray`
    fails; assert the held-out reward rose by >= 0.15. Returns (output dir, log file, summary)."""
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    args = ["--config", str(ROOT / "experiments" / "quickstart_local.yaml"), "--output_dir", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "marin_rl.run", *args, "--orchestrator.num_steps", "100", *overrides],
        cwd=ROOT,
        env=_without_ray(tmp_path),
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    _finish(proc, log, timeout_s)
    summary = json.loads((out / "summary.json").read_text())
    gain = summary["eval_reward_end"] - summary["eval_reward_start"]
    assert gain >= 0.15, f"held-out reward {summary['eval_reward_start']:.3f} -> {summary['eval_reward_end']:.3f}"
    return out, log, summary


@pytest.mark.slow
def test_quickstart_local_learns_in_one_process_without_ray(tmp_path):
    """experiments/quickstart_local.yaml, shortened to 100 RL steps, in a process where `import ray` fails: held-out
    reward rises, every version is handed over with 0 bytes copied and one resident copy of the policy."""
    out, log, summary = _local_quickstart_learns(tmp_path, 600)
    assert summary["broadcast_transport"] == "colocated" and summary["steps"] == 100
    rows = read_metrics(str(out / "metrics.jsonl"))
    handed = [r for r in rows if "broadcast/bytes" in r]
    assert len(handed) == 101, "a hand-over at the start and after every step"
    assert all(r["broadcast/bytes"] == 0 for r in handed), "the engine reads the learner's arrays: nothing copied"
    assert all(r["broadcast/resident_policy_bytes"] == r["broadcast/policy_bytes"] > 0 for r in handed)
    assert all(r["batches/staleness/max"] <= 2 for r in rows if "batches/staleness/max" in r), "replay.max_age: 2"
    assert (out / "reward.png").exists() and (out / "hf" / "step-100" / "config.json").exists()
    # time/elapsed_s counts seconds from the run's start; the row's Unix time is time/unix
    elapsed = [r["time/elapsed_s"] for r in rows if "time/elapsed_s" in r]
    assert len(elapsed) == 101 and elapsed == sorted(elapsed) and 0 < elapsed[-1] < min(summary["wall_time_s"], 1e6)
    text = log.read_text()  # a file, not a terminal: plain lines, no colour codes, no bar, no short-wait lines
    assert "\x1b[" not in text and "\r" not in text and "batcher: waiting 0s" not in text
    assert "RL: step 100/100 (100%)" in text and "done: eval reward" in text
    timed = [r for r in rows if "time/unix" in r]
    assert all(abs((r["time/unix"] - r["time/elapsed_s"]) - (timed[0]["time/unix"] - elapsed[0])) < 1 for r in timed)


@pytest.mark.slow
def test_quickstart_local_learns_in_bfloat16(tmp_path):
    """experiments/quickstart_local.yaml at `model.compute_dtype: bfloat16` (mixed precision: float32 parameters,
    bfloat16 forward and backward passes in the learner, the engine serving the bfloat16 cast), 100 RL steps: the
    held-out reward rises as at float32, and every hand-over casts the learner's arrays for the engine."""
    out, _, _ = _local_quickstart_learns(tmp_path, 900, "--model.compute_dtype", "bfloat16")
    handed = [r for r in read_metrics(str(out / "metrics.jsonl")) if "broadcast/bytes" in r]
    assert len(handed) == 101 and all(0 < r["broadcast/bytes"] < r["broadcast/policy_bytes"] for r in handed[1:])


@pytest.mark.gate_run  # SIGKILL + resume equals the uninterrupted run
def test_local_run_killed_with_sigkill_resumes_exactly(tmp_path):
    """Deterministic local runs, without Ray: one uninterrupted; one SIGKILLed after a checkpoint and a later step,
    then resumed to the end. The same batches, losses and final arrays; every step trained once."""
    steps, every = 10, 3
    env = _without_ray(tmp_path)
    ref_cfg = deterministic_config(tmp_path / "reference", steps, every, backend="local")
    cfg = deterministic_config(tmp_path / "killed", steps, every, backend="local")
    ref_log, log, out = tmp_path / "reference.log", tmp_path / "killed.log", tmp_path / "killed"
    reference = _start(ref_cfg, ref_log, env)
    procs = [reference]
    try:
        proc = _start(cfg, log, env)
        procs.append(proc)
        saved, killed_after = _signal_when(proc, log, out, signal.SIGKILL, lambda s, last: s and last > max(s))
        proc.wait()
        first_resume = max(saved)
        assert 1 <= first_resume < killed_after < steps
        proc = _start(cfg, log, env)
        procs.append(proc)
        _finish(proc, log, 400)
        _finish(reference, ref_log, 400)
    finally:
        _stop_all(procs)
    text = log.read_text()
    assert f"resumed from step {first_resume}" in text and warm_starts(text) == 1
    assert [m["step"] for m in _markers(out)] == [first_resume]
    rows = read_metrics(str(out / "metrics.jsonl"))
    ref_rows = read_metrics(str(tmp_path / "reference" / "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(steps + 1)) == [r["step"] for r in ref_rows]
    for r, ref in zip(rows[1:], ref_rows[1:], strict=True):
        for key in ("batches/rollouts", "batches/tokens", "batches/trained_tokens", "batches/addition/reward/mean"):
            assert r[key] == ref[key], (r["step"], key)
        for key in ("learner/loss", "learner/grad_norm", "learner/entropy", "learner/kl_sampler"):
            np.testing.assert_allclose(r[key], ref[key], rtol=1e-5, atol=1e-7, err_msg=f"step {r['step']} {key}")
    assert any(abs(r["learner/loss"]) > 1e-4 for r in ref_rows[1:]), "the comparison needs a learning signal"
    for a, b in zip(
        final_learner_arrays(cfg, out, steps),
        final_learner_arrays(ref_cfg, tmp_path / "reference", steps),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    summary = json.loads((out / "summary.json").read_text())
    ref_summary = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert summary["generated_tokens"] == ref_summary["generated_tokens"], "nothing generated twice or lost"
    assert _progress(out)[1] == steps


# ---- the colocated engine -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def colocated():
    tok = build_char_tokenizer()
    env = AdditionEnvironment(tok, max_operand=49, num_eval=20)
    learner = Learner(
        ModelConfig(architecture=tiny_llama()), LearnerConfig(warm_start=WarmStartConfig(steps=20)), len(tok)
    )
    examples = [(env.encode_prompt(p), tok(p.answer)["input_ids"] + [tok.eos_token_id]) for p in env.train_problems()]
    learner.warm_start(examples, 64)
    server = LevanterInferenceServer(
        learner.model,
        tok,
        InferenceConfig(max_seqs=64, max_seq_len=64, levanter=LevanterServerConfig(engine="dense")),
        share_weights=True,
    )
    address = server.start()
    yield tok, env, learner, server, address
    server.stop()


def _pointers(model) -> list[int]:
    return [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(model) if isinstance(x, jax.Array)]


def test_serve_model_shares_the_learners_arrays_and_copies_only_what_differs(colocated):
    tok, env, learner, server, _ = colocated
    result = server.serve_model(7, learner.model)
    assert result["bytes"] == 0 and result["arrays"] == 0 and server.version == 7
    assert _pointers(server.context.model) == _pointers(learner.model), "the engine reads the learner's buffers"
    assert policy_bytes(learner.model, server.context.model) == policy_bytes(learner.model)
    # a policy in another dtype is cast on the device to the served one: every array copied, values kept
    half = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16) if isinstance(x, jax.Array) else x, learner.model)
    result = server.serve_model(8, half)
    leaves = [x for x in jax.tree_util.tree_leaves(learner.model) if isinstance(x, jax.Array)]
    assert result["arrays"] == len(leaves) and result["bytes"] == sum(x.size * 4 for x in leaves)
    served = [x for x in jax.tree_util.tree_leaves(server.context.model) if isinstance(x, jax.Array)]
    for a, b in zip(served, jax.tree_util.tree_leaves(half), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.float32)))
    with pytest.raises(ValueError, match="shape"):
        server.serve_model(9, jax.tree_util.tree_map(lambda x: x[..., :1] if isinstance(x, jax.Array) else x, half))
    server.serve_model(0, learner.model)


def test_in_process_client_answers_exactly_what_the_http_client_answers(colocated):
    """The same seeded requests through HTTP (`PolicyClient`) and in-process (`InProcessPolicyClient`): the same
    tokens, logprobs, text, finish reasons and versions; a bad request fails the same way (a 400)."""
    tok, env, learner, server, address = colocated
    server.serve_model(3, learner.model)
    prompts = [env.encode_prompt(p) for p in env.eval_problems()[:6]]

    async def both():
        http, local = PolicyClient([address]), InProcessPolicyClient(server)
        try:
            kwargs = dict(n=3, max_tokens=5, temperature=1.0, stop_token_ids=[tok.eos_token_id])
            a = [await http.sample(p, seed=100 + i, **kwargs) for i, p in enumerate(prompts)]
            b = [await local.sample(p, seed=100 + i, **kwargs) for i, p in enumerate(prompts)]
            errors = []
            for client in (http, local):
                try:
                    await client.sample([1] * 64, max_tokens=5)
                except Exception as e:  # noqa: BLE001 - compared below
                    errors.append(e)
            return a, b, errors, local
        finally:
            await http.aclose()

    a, b, errors, local = asyncio.run(both())
    for x, y in zip([s for g in a for s in g], [s for g in b for s in g], strict=True):
        assert x.token_ids == y.token_ids and x.text == y.text and x.finish_reason == y.finish_reason
        np.testing.assert_allclose(x.sampler_logprobs, y.sampler_logprobs, rtol=0, atol=1e-6)
        assert x.token_versions == y.token_versions == [3] * len(x.token_ids)
        assert (x.version_start, x.version_end) == (y.version_start, y.version_end) == (3, 3)
    assert len({tuple(s.token_ids) for g in a for s in g}) > 1, "seeded samples should differ between seeds"
    assert [getattr(e, "status", None) for e in errors] == [400, 400]
    assert "exceeds max_seq_len" in errors[1].detail
    assert local.requests == len(prompts) and local.retried_requests == 0


# ---- configs ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--inference.backend", "vllm"], "inference.backend must be 'levanter'"),
        (["--inference.num_servers", "2"], "set inference.num_servers: 1"),
        (["--learner.hosts", "2", "--inference.levanter.engine", "paged"], "set inference.levanter.engine: dense"),
        (["--orchestrator.ray_address", "auto"], "orchestrator.ray_address is set"),
        (["--orchestrator.backend", "slurm"], "orchestrator.backend must be 'ray' or 'local'"),
    ],
)
def test_the_local_backend_names_what_it_cannot_run(overrides, message):
    with pytest.raises(SystemExit) as e:
        parse_config(["--config", str(ROOT / "experiments" / "quickstart_local.yaml"), *overrides])
    text = str(e.value)
    assert message in text and "\n" not in text


@pytest.mark.parametrize(
    "name,hosts,devices,mesh",
    [
        ("tpu_v5e_8_local.yaml", 1, 8, {"data": 1, "fsdp": 8, "tensor": 1}),
        ("tpu_v4_32_local.yaml", 4, 16, {"data": 1, "fsdp": 16, "tensor": 1}),
        ("gpu_local.yaml", 1, 1, {"data": 1, "fsdp": 1, "tensor": 1}),
    ],
)
def test_accelerator_host_configs_are_accepted_and_mapped(name, hosts, devices, mesh):
    """The accelerator configs of the local backend (learner and engine in one process per host: on a TPU VM only
    one process may open the chips): the learner's mesh spans every host's devices, one process per host, and
    the mesh does not fit fewer devices."""
    cfg = parse_config(["--config", str(ROOT / "experiments" / name)])
    assert cfg.orchestrator.backend == "local" and cfg.learner.hosts == hosts and cfg.inference.num_servers == 1
    assert cfg.inference.levanter.engine == "dense" or hosts == 1
    assert cfg.learner.mesh.shape(devices) == mesh
    if devices > 1:
        with pytest.raises(ValueError, match="devices"):
            cfg.learner.mesh.shape(devices // 2)
    raw = yaml.safe_load((ROOT / "experiments" / name).read_text())
    assert "placement" not in raw, "one process: nothing to place"


SHARDED_SAMPLING = r"""
import asyncio, json, sys
import jax, numpy as np
mode, weights = sys.argv[1], sys.argv[2]
assert jax.device_count() == (4 if mode == "sharded" else 1), jax.devices()
from marin_rl.envs.arithmetic import AdditionEnvironment
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.inference.local_client import InProcessPolicyClient
from marin_rl.learner.config import LearnerConfig, MeshConfig, WarmStartConfig
from marin_rl.learner.learner import Learner
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.tokenizer import build_char_tokenizer

tok = build_char_tokenizer()
env = AdditionEnvironment(tok, max_operand=49, num_eval=16)
inference = InferenceConfig(max_seqs=16, max_seq_len=64, levanter=LevanterServerConfig(engine="dense"))
out = {}
if mode == "sharded":  # a learner sharded over 4 devices; the colocated engine serves its arrays
    cfg = LearnerConfig(warm_start=WarmStartConfig(steps=20), mesh=MeshConfig(data=1, fsdp=4))
    learner = Learner(ModelConfig(architecture=tiny_llama()), cfg, len(tok))
    pairs = [(env.encode_prompt(p), tok(p.answer)["input_ids"] + [tok.eos_token_id]) for p in env.train_problems()]
    learner.warm_start(pairs, 64)
    server = LevanterInferenceServer(learner.model, tok, inference, name="colocated", share_weights=True)
    out["bytes"] = server.serve_model(1, learner.model)["bytes"]
    out["devices"] = len(jax.tree_util.tree_leaves(server.context.model)[0].sharding.device_set)
    np.savez(weights, *learner.weights())
else:  # the same weights in a one-device process
    learner = Learner(ModelConfig(architecture=tiny_llama()), LearnerConfig(), len(tok))
    server = LevanterInferenceServer(learner.model, tok, inference, name="single")
    stored = np.load(weights)
    server.apply_weights(1, [stored[f"arr_{i}"] for i in range(len(stored.files))])

async def sample():
    client = InProcessPolicyClient(server)
    samples = []
    for i, problem in enumerate(env.eval_problems()):
        kwargs = dict(n=4, max_tokens=5, seed=10 * i, stop_token_ids=[tok.eos_token_id])
        answer = await client.sample(env.encode_prompt(problem), **kwargs)
        samples += [(s.token_ids, s.sampler_logprobs) for s in answer]
    return samples

out["samples"] = asyncio.run(sample())
server.stop()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_colocated_engine_samples_from_sharded_weights_what_one_device_samples(tmp_path):
    """A learner sharded over 4 devices (fsdp): the colocated engine serves its sharded arrays as they are (0 bytes
    copied) and samples the same tokens, with the same logprobs, as an engine in a one-device process given the same
    weights and seeds."""
    results = {}
    for mode, devices in (("sharded", 4), ("single", 1)):
        env = dict(
            _without_ray(tmp_path),
            XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
            JAX_PLATFORMS="cpu",
        )
        proc = subprocess.run(
            [sys.executable, "-c", SHARDED_SAMPLING, mode, str(tmp_path / "weights.npz")],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    sharded, single = results["sharded"], results["single"]
    assert sharded["bytes"] == 0 and sharded["devices"] == 4, "the engine reads the learner's sharded arrays"
    assert len(sharded["samples"]) == len(single["samples"]) == 64
    for (tokens_a, lp_a), (tokens_b, lp_b) in zip(sharded["samples"], single["samples"], strict=True):
        assert tokens_a == tokens_b
        np.testing.assert_allclose(lp_a, lp_b, rtol=0, atol=1e-5)


def test_an_offloaded_optimizer_state_trains_exactly_like_one_kept_on_the_devices():
    """learner.offload_optimizer: between steps the optimizer state is host memory (no device array), and the
    steps are the same as without offloading, bit for bit."""
    from random_packed_batch import random_packed_batch

    learners = []
    for offload in (False, True):
        cfg = LearnerConfig(offload_optimizer=offload)
        learner = Learner(ModelConfig(architecture=tiny_llama()), cfg, 80)
        metrics = [learner.train_step(random_packed_batch(s, 4, 32, 80, segments=2)) for s in range(3)]
        learners.append((learner, metrics))
    (kept, kept_metrics), (offloaded, offloaded_metrics) = learners
    on_device = [x for x in jax.tree_util.tree_leaves(offloaded.opt_state) if isinstance(x, jax.Array)]
    assert not on_device and offloaded._offloaded is not None, "between steps the optimizer state is on the host"
    assert [m["learner/loss"] for m in kept_metrics] == [m["learner/loss"] for m in offloaded_metrics]
    for a, b in zip(jax.tree_util.tree_leaves(kept.model), jax.tree_util.tree_leaves(offloaded.model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    state = offloaded.state()  # a checkpoint takes device arrays again
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(state.opt_state))


# ---- several hosts: one process per host ----------------------------------------------------------------------------
MULTIHOST_SAMPLING = r"""
import json, sys
mode, weights = sys.argv[1], sys.argv[2]
if mode == "two":
    from marin_rl.learner.distributed import initialize
    initialize(sys.argv[3], 2, int(sys.argv[4]))
import equinox as eqx, jax, numpy as np
assert jax.device_count() == 4, jax.devices()
from levanter.inference.engine import Request
from marin_rl.envs.arithmetic import AdditionEnvironment
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.dense_engine import DenseDecodeParams
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.learner.config import LearnerConfig, MeshConfig, WarmStartConfig
from marin_rl.learner.learner import Learner
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.tokenizer import build_char_tokenizer

tok = build_char_tokenizer()
env = AdditionEnvironment(tok, max_operand=49, num_eval=16)
cfg = LearnerConfig(warm_start=WarmStartConfig(steps=20), mesh=MeshConfig(data=1, fsdp=4))
learner = Learner(ModelConfig(architecture=tiny_llama()), cfg, 80)
params, static = eqx.partition(learner.model, eqx.is_array)
if mode == "one":
    pairs = [(env.encode_prompt(p), tok(p.answer)["input_ids"] + [tok.eos_token_id]) for p in env.train_problems()]
    learner.warm_start(pairs, 64)
    np.savez(weights, *learner.weights())
else:  # the same weights, laid out over both processes' devices
    stored = np.load(weights)
    old, treedef = jax.tree_util.tree_flatten(params)
    new = [
        jax.make_array_from_callback(o.shape, o.sharding, lambda index, a=stored[f"arr_{i}"]: a[index])
        for i, o in enumerate(old)
    ]
    learner.model = eqx.combine(jax.tree_util.tree_unflatten(treedef, new), static)
inference = InferenceConfig(max_seqs=64, max_seq_len=64, levanter=LevanterServerConfig(engine="dense"))
server = LevanterInferenceServer(learner.model, tok, inference, share_weights=True)
engine = server.context.engine
stop = server.context._stop_array(((tok.eos_token_id,),))
requests = []
for i, problem in enumerate(env.eval_problems()):
    prompt = env.encode_prompt(problem)
    for k in range(4):
        params = DenseDecodeParams(np.int32(len(prompt) + 5), stop, np.float32(1.0), np.float32(1.0),
                                   np.array([0, 100 * i + k], np.uint32))
        requests.append(Request(prompt_tokens=prompt, request_id=len(requests), decode_params=params, n_generations=1))
result = engine.generate(requests)  # every process makes the same call: one program over the 4 devices
server.stop()
shards = len(jax.tree_util.tree_leaves(server.context.model)[0].sharding.device_set)
if jax.process_index() == 0:
    print(json.dumps({"tokens": result.tokens, "logprobs": result.logprobs, "devices": shards}))
"""


@pytest.mark.slow
def test_two_processes_sample_what_one_process_samples(tmp_path):
    """The colocated engine on a learner sharded over 2 processes × 2 devices samples, from the same weights and
    seeds, the same tokens with the same logprobs as on 1 process × 4 devices."""
    weights = str(tmp_path / "weights.npz")
    one_env = dict(_without_ray(tmp_path), XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    one = subprocess.run(
        [sys.executable, "-c", MULTIHOST_SAMPLING, "one", weights],
        cwd=ROOT,
        env=one_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-4000:]
    two_env = dict(one_env, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MULTIHOST_SAMPLING, "two", weights, coordinator, str(pid)],
            cwd=ROOT,
            env=two_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-4000:]
    a = json.loads(one.stdout.strip().splitlines()[-1])
    b = json.loads(outputs[0][0].strip().splitlines()[-1])
    assert a["devices"] == b["devices"] == 4 and len(a["tokens"]) == 64
    assert a["tokens"] == b["tokens"]
    for x, y in zip(a["logprobs"], b["logprobs"], strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.gate_run  # the local backend learns, on two processes
def test_a_two_process_local_run_learns(tmp_path):
    """experiments/quickstart_local.yaml on 2 processes (one per "host", `learner.hosts: 2`, the data axis over both),
    started like torchrun with the coordinator in the environment, without Ray: process 0 drives, process 1 follows;
    the held-out reward rises, every step is trained once, and both processes end cleanly."""
    out = tmp_path / "run"
    coordinator = f"127.0.0.1:{_free_port()}"
    args = [
        sys.executable,
        "-m",
        "marin_rl.run",
        "--config",
        str(ROOT / "experiments" / "quickstart_local.yaml"),
        "--output_dir",
        str(out),
        "--orchestrator.num_steps",
        "60",
        "--orchestrator.eval_every",
        "60",
        "--learner.hosts",
        "2",
        "--learner.mesh.data",
        "2",
    ]
    logs = [tmp_path / f"process-{pid}.log" for pid in range(2)]
    procs = []
    for pid in range(2):
        env = dict(
            _without_ray(tmp_path),
            MARIN_RL_COORDINATOR=coordinator,
            MARIN_RL_NUM_PROCESSES="2",
            MARIN_RL_PROCESS_ID=str(pid),
            JAX_PLATFORMS="cpu",
        )
        procs.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=open(logs[pid], "wb"), stderr=subprocess.STDOUT))
    try:
        for p, log in zip(procs, logs, strict=True):
            assert p.wait(timeout=900) == 0, log.read_text()[-6000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 60
    assert summary["eval_reward_end"] - summary["eval_reward_start"] >= 0.1, summary
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows if "learner/loss" in r] == list(range(1, 61))
    assert all(r["broadcast/bytes"] == 0 for r in rows if "broadcast/bytes" in r)
    assert "process 1 of 2" in logs[1].read_text() and "follower 1:" in logs[1].read_text()
