"""Two Ray nodes on one machine: the learner on one (the head, on the machine's address, custom resource
`learner_node`), the inference server and the env actors on the other (address 127.0.0.2, resource
`rollout_node`). Weights cross nodes through the Ray object store, requests go to the server's advertised node
address. A second run loses the rollout node mid-run (its raylet and every process on it killed), gets a new node
(127.0.0.3) with the same resources, and finishes: the server and env actors are recreated there and the server
gets the latest weights before serving.
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

from marin_rl.placement import RoleResources
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


def _config(cluster, out, steps: int, eval_every: int):
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
            "120",
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


def test_losing_the_rollout_node_mid_run_recovers(cluster, tmp_path):
    c, node = cluster
    out = tmp_path / "run"
    result: dict = {}

    def run_in_background():
        try:
            result["summary"] = run(_config(c, out, steps=30, eval_every=30))
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            result["error"] = e

    runner = threading.Thread(target=run_in_background, daemon=True)
    runner.start()
    # Ray adds and removes nodes from the main thread only: the run goes on in the background meanwhile.
    metrics = out / "metrics.jsonl"
    killed_at = None
    deadline = time.time() + 900
    while killed_at is None and runner.is_alive() and time.time() < deadline:
        if metrics.exists():
            steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if "learner/loss" in x]
            if steps and max(steps) >= 10:
                killed_at = max(steps)
                c.remove_node(node, allow_graceful=False)
                time.sleep(3)
                # a replacement machine (a new address) with the same resources joins
                c.add_node(**{**ROLLOUT_NODE, "node_ip_address": "127.0.0.3"})
        time.sleep(0.5)
    runner.join(timeout=1200)
    assert "error" not in result, result.get("error")
    assert killed_at is not None, "the run ended before the node could be killed"
    summary = result["summary"]
    assert summary["steps"] == 30
    assert summary["server_restarts"] >= 1 and summary["env_restarts"] >= 1, summary
    assert [a.split(":")[0] for a in summary["server_addresses"]] == ["127.0.0.3"]  # serving from the new node
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    steps = [r for r in rows if "learner/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    after = [r for r in steps if r["step"] > killed_at + 2]
    assert after and all(r["batches/staleness/max"] <= 2 for r in after)  # the new server serves current weights
