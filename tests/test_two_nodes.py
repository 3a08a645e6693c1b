"""Two Ray nodes on one machine: the learner on one (the head, on the machine's address, custom resource
`learner_node`), the inference server and the env actors on the other (address 127.0.0.2, resource
`rollout_node`). Weights cross nodes through the Ray object store, requests go to the server's advertised node
address. Losing the rollout node mid-run (its raylet and every process on it SIGKILLed): when a new node (127.0.0.3)
with the same resources joins within `placement.wait_timeout_s`, the server and the env actor are recreated there,
the server gets the latest weights before serving and the run finishes; when none joins, the run fails within that
wait with a `PlacementError` naming the resource and the lost node.
"""

import dataclasses
import json
import os
import threading
import time

import pytest
import ray
from ray._private.utils import get_ray_address_file
from ray.cluster_utils import Cluster

from marin_rl.placement import PlacementError, RoleResources
from marin_rl.run import parse_config, run

pytestmark = pytest.mark.slow

ROLLOUT_NODE = dict(node_ip_address="127.0.0.2", num_cpus=2, resources={"rollout_node": 1})


def forget_cluster_address(address: str) -> None:
    """Remove Ray's record of `address` as this machine's cluster (written by `Cluster`), so that a later
    `ray.init()` starts a Ray of its own instead of connecting to the cluster that is gone."""
    path = get_ray_address_file(None)
    if os.path.exists(path) and open(path).read().strip() == address:
        os.remove(path)


@pytest.fixture
def cluster():
    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=2, resources={"learner_node": 1}))
    node = c.add_node(**ROLLOUT_NODE)
    yield c, node
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()
    forget_cluster_address(c.address)  # a later ray.init() starts its own Ray instead of looking for this cluster


def _config(cluster, out, steps: int, eval_every: int, wait_timeout_s: float = 120, *more: str):
    config = parse_config(
        [
            "--config",
            "experiments/quickstart.yaml",
            "--output_dir",
            str(out),
            "--orchestrator.num_steps",
            str(steps),
            "--orchestrator.eval_every",
            str(eval_every),
            "--orchestrator.ray_address",
            cluster.address,
            "--placement.wait_timeout_s",
            str(wait_timeout_s),
            *more,
        ]
    )
    placement = dataclasses.replace(
        config.placement,
        learner=RoleResources(resources={"learner_node": 1}),
        servers=RoleResources(resources={"rollout_node": 0.5}),
        envs=RoleResources(resources={"rollout_node": 0.1}),
    )
    return dataclasses.replace(config, placement=placement)


def test_learner_on_one_node_rollouts_on_another(cluster, tmp_path):
    c, _ = cluster
    summary = run(_config(c, tmp_path / "run", steps=80, eval_every=40))
    assert summary["steps"] == 80
    assert summary["broadcast_transport"] == "ray"  # more than one node: the object store carries the weights
    assert [a.split(":")[0] for a in summary["server_addresses"]] == ["127.0.0.2"]
    assert summary["eval_reward_end"] - summary["eval_reward_start"] >= 0.1, summary


WAIT_S = 30
"""`placement.wait_timeout_s` of the node-loss runs: long enough for a process to start on this small machine."""


def _lose_the_rollout_node(c, node, config, kill_at: int, replace_after_s: float | None) -> dict:
    """Run `config` in the background and SIGKILL the rollout node once step `kill_at` is logged; a new node with
    the same resources joins `replace_after_s` later (None: none). Returns the run's 'summary' or 'error', when the
    node was killed ('killed_step', 'killed_at') and when the run ended ('ended_at')."""
    result: dict = {}

    def run_in_background():
        try:
            result["summary"] = run(config)
        except BaseException as e:  # noqa: BLE001 - reported by the tests
            result["error"] = e
        result["ended_at"] = time.time()

    runner = threading.Thread(target=run_in_background, daemon=True)
    runner.start()
    # Ray adds and removes nodes from the main thread only: the run goes on in the background meanwhile.
    metrics = os.path.join(config.output_dir, "metrics.jsonl")
    deadline = time.time() + 600
    while "killed_at" not in result and runner.is_alive() and time.time() < deadline:
        if os.path.exists(metrics):
            steps = [json.loads(x)["step"] for x in open(metrics).read().splitlines() if "learner/loss" in x]
            if steps and max(steps) >= kill_at:
                result["killed_step"] = max(steps)
                c.remove_node(node, allow_graceful=False)  # SIGKILLs its raylet and every process on it
                result["killed_at"] = time.time()
                if replace_after_s is not None:
                    time.sleep(replace_after_s)
                    # a replacement machine (a new address) with the same resources joins
                    c.add_node(**{**ROLLOUT_NODE, "node_ip_address": "127.0.0.3"})
        time.sleep(0.2)
    runner.join(timeout=600)
    assert "killed_at" in result, f"the run ended before the node could be killed: {result.get('error')!r}"
    return result


def test_losing_the_rollout_node_mid_run_recovers_on_a_new_node(cluster, tmp_path):
    c, node = cluster
    config = _config(c, tmp_path / "run", 8, 8, WAIT_S, "--learner.warm_start.steps", "20")
    result = _lose_the_rollout_node(c, node, config, kill_at=3, replace_after_s=5)
    assert "error" not in result, result.get("error")
    summary = result["summary"]
    print(
        f"\nnode lost at step {result['killed_step']}; run ended {result['ended_at'] - result['killed_at']:.1f}s later"
    )
    assert summary["steps"] == 8
    assert summary["server_restarts"] >= 1 and summary["env_restarts"] >= 1, summary
    assert [a.split(":")[0] for a in summary["server_addresses"]] == ["127.0.0.3"]  # serving from the new node
    rows = [json.loads(x) for x in open(os.path.join(config.output_dir, "metrics.jsonl")).read().splitlines()]
    steps = [r for r in rows if "learner/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert steps[-1]["envs/addition/actor_restarts"] >= 1 and steps[-1]["servers/restarts"] >= 1
    after = [r for r in steps if r["step"] > result["killed_step"] + 2]
    assert after and all(r["batches/staleness/max"] <= 2 for r in after)  # the new server serves current weights


def test_losing_the_rollout_node_for_good_fails_naming_the_resource(cluster, tmp_path):
    c, node = cluster
    config = _config(c, tmp_path / "run", 100, 100, WAIT_S, "--learner.warm_start.steps", "20")
    result = _lose_the_rollout_node(c, node, config, kill_at=2, replace_after_s=None)
    error, waited = result.get("error"), result["ended_at"] - result["killed_at"]
    print(f"\nnode lost at step {result['killed_step']}; the run failed {waited:.1f}s later: {error}")
    assert isinstance(error, PlacementError), repr(error)
    message = str(error)
    assert "no live node offers {rollout_node:" in message and "127.0.0.2" in message, message
    assert f"placement.wait_timeout_s={WAIT_S}s" in message, message
    assert waited <= WAIT_S + 10, f"failed {waited:.1f}s after the node was lost"
