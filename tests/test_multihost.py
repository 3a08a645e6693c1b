"""The learner across processes: 2 processes x 2 simulated CPU devices (one JAX distributed runtime, Gloo
collectives) train exactly like 1 process x 4 devices, and a checkpoint two processes wrote together loads in one.

Each learner process is a subprocess started with `XLA_FLAGS=--xla_force_host_platform_device_count=N`; process 0
is the coordinator. Every process trains the tiny Llama for two steps on the same packed batches (each feeds its
own devices' rows) and saves metrics and the gathered parameters; process 0's files are compared with the
one-process run's.
"""

import json
import socket
import subprocess
import sys

import numpy as np
import pytest
from subprocess_env import TESTS, subprocess_env

pytestmark = pytest.mark.slow

WORKER = r"""
import json, os, sys
out_dir, pid, nproc, coordinator, case = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
mesh, mode = json.loads(sys.argv[6]), sys.argv[7]
from marin_rl.learner.distributed import initialize
initialize(coordinator, nproc, pid)
import jax
import numpy as np
from marin_rl.checkpoint_dirs import begin_checkpoint
from marin_rl.learner.checkpoint import load_learner_state, save_learner_state
from marin_rl.learner.config import LearnerConfig, LossConfig, MeshConfig
from marin_rl.learner.learner import Learner
from marin_rl.learner.optimizer import OptimizerConfig
from marin_rl.model.config import ModelConfig, tiny_llama
from random_packed_batch import random_packed_batch

assert jax.device_count() == 4, jax.devices()
ROWS, SEQ, VOCAB = 8, 48, 128


def batch(seed):
    return random_packed_batch(seed, ROWS, SEQ, VOCAB, segments=2)


def learner():
    cfg = LearnerConfig(
        optimizer=OptimizerConfig(learning_rate=1e-3),
        loss=LossConfig(objective="ppo", kl_coef=0.05),
        mesh=MeshConfig(**mesh),
        microbatches=2,
    )
    return Learner(ModelConfig(architecture=tiny_llama()), cfg, VOCAB)


if mode == "train":
    lrn = learner()
    metrics = [lrn.train_step(batch(step)) for step in range(2)]
    weights = lrn.weights()  # gathered: every process must call it
    logprobs = lrn.logprobs(batch(7))
    ckpt = begin_checkpoint(f"{out_dir}/ckpt", 2)
    save_learner_state(lrn, ckpt, 2)
    if pid == 0:
        np.savez(f"{out_dir}/{case}.npz", *weights)
        np.save(f"{out_dir}/{case}_logprobs.npy", logprobs)
        with open(f"{out_dir}/{case}.json", "w") as f:
            json.dump({"metrics": metrics, "processes": jax.process_count(), "devices": jax.device_count()}, f)
else:  # load the checkpoint `case` wrote, in this process count
    lrn = learner()
    load_learner_state(lrn, f"{out_dir}/ckpt/step-2")
    if pid == 0:
        np.savez(f"{out_dir}/{case}_loaded.npz", *lrn.weights())
        with open(f"{out_dir}/{case}_loaded.json", "w") as f:
            json.dump({"version": lrn.version, "optimizer_steps": lrn.optimizer_steps}, f)
    else:
        lrn.weights()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes(what: str, script: str, args: list[list[str]], timeout: int, **env) -> None:
    """Run `script` in one subprocess per argument list, together, and check that every one succeeded."""
    env = subprocess_env(TESTS, JAX_PLATFORMS="cpu", **env)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *a], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for a in args
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"{what} process {i} failed:\n{logs[i][-4000:]}"


def _run(out, case: str, nproc: int, mesh: dict, mode: str = "train", timeout: int = 600) -> None:
    coordinator = f"127.0.0.1:{_free_port()}"
    args = [[str(out), str(i), str(nproc), coordinator, case, json.dumps(mesh), mode] for i in range(nproc)]
    _processes(case, WORKER, args, timeout, XLA_FLAGS=f"--xla_force_host_platform_device_count={4 // nproc}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    dirs = {}
    for case, nproc, mesh in [
        ("one_process", 1, {"data": 2, "fsdp": 2}),
        ("two_processes", 2, {"data": 2, "fsdp": 2}),
        ("two_processes_fsdp", 2, {"data": 1, "fsdp": 4}),
    ]:
        out = tmp_path_factory.mktemp(case)
        _run(out, case, nproc, mesh)
        dirs[case] = out
    return dirs


def _load(out, case):
    with open(out / f"{case}.json") as f:
        info = json.load(f)
    with np.load(out / f"{case}.npz") as z:
        weights = [z[k] for k in z.files]
    return info, weights, np.load(out / f"{case}_logprobs.npy")


@pytest.mark.parametrize("case", ["two_processes", "two_processes_fsdp"])
def test_two_processes_train_like_one(runs, case):
    ref_info, ref_w, ref_lp = _load(runs["one_process"], "one_process")
    info, w, lp = _load(runs[case], case)
    assert (info["processes"], info["devices"]) == (2, 4)
    assert (ref_info["processes"], ref_info["devices"]) == (1, 4)
    for step, (m, r) in enumerate(zip(info["metrics"], ref_info["metrics"], strict=True)):
        for key in ("loss", "kl_ref", "grad_norm"):
            if key in r:
                np.testing.assert_allclose(m[key], r[key], rtol=1e-5, atol=1e-6, err_msg=f"step {step} {key}")
    assert len(w) == len(ref_w)
    moved = 0.0
    for a, b in zip(w, ref_w, strict=True):
        np.testing.assert_allclose(a, b, atol=5e-5)
        moved = max(moved, float(np.abs(a).max()))
    assert moved > 0
    np.testing.assert_allclose(lp, ref_lp, atol=5e-5)


def test_checkpoint_of_two_processes_loads_in_one(runs, tmp_path):
    out = runs["two_processes"]
    _run(out, "two_processes", 1, {"data": 2, "fsdp": 2}, mode="load")
    with open(out / "two_processes_loaded.json") as f:
        assert json.load(f) == {"version": 2, "optimizer_steps": 2}
    with np.load(out / "two_processes_loaded.npz") as z:
        loaded = [z[k] for k in z.files]
    _, trained, _ = _load(out, "two_processes")
    for a, b in zip(loaded, trained, strict=True):
        np.testing.assert_array_equal(a, b)


LATE_WORKER = r"""
import sys, time
pid, coordinator = int(sys.argv[1]), sys.argv[2]
from marin_rl.learner.distributed import initialize
initialize(coordinator, 2, pid)
import jax, numpy as np
from jax.experimental import multihost_utils
if pid == 1:
    time.sleep(35)  # a process slowed down (a busy host) reaches its first collective late
gathered = multihost_utils.process_allgather(np.array([pid + 1.0]))
assert gathered.tolist() == [[1.0], [2.0]], gathered
"""


def test_a_process_reaching_its_first_collective_late_does_not_fail_the_others():
    """Gloo gives processes 30 s (fixed in XLA) to meet at the collective that sets its context up: `initialize`
    lines the processes up and sets it up, so a process that later arrives 35 s behind the other is waited for."""
    coordinator = f"127.0.0.1:{_free_port()}"
    _processes("late collective", LATE_WORKER, [[str(i), coordinator] for i in range(2)], timeout=300)


def test_run_with_a_two_host_learner_learns(tmp_path):
    from marin_rl.run import parse_config, run

    config = parse_config(
        [
            "--config",
            "experiments/quickstart.yaml",
            "--output_dir",
            str(tmp_path / "run"),
            "--orchestrator.num_steps",
            "60",
            "--orchestrator.eval_every",
            "60",
            "--learner.hosts",
            "2",
            "--learner.mesh.data",
            "2",
        ]
    )
    summary = run(config)
    assert summary["steps"] == 60
    assert summary["eval_reward_end"] - summary["eval_reward_start"] >= 0.1, summary
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "learner/loss" in r] == list(range(1, 61))
    assert (tmp_path / "run" / "hf" / "step-60" / "config.json").exists()  # exported once, by process 0's learner
