"""Where each role runs: Ray resources per role, TPU slices, colocation, and requests the cluster cannot meet.

The TPU figures are the published shapes of Cloud TPU slices (a v4-32 is topology 2x2x4: 16 chips on 4 hosts of
4; a v5litepod-16 is 4x4: 16 chips on 4 hosts of 4), not read back from the code under test.
"""

import os
import subprocess
import sys
import time

import pytest
import ray

from marin_rl.config import parse_config
from marin_rl.orchestrator.ray_backend.launcher import Launcher
from marin_rl.placement import (
    PlacementConfig,
    PlacementError,
    RoleResources,
    check_feasible,
    lost_placement,
    tpu_slice_shape,
    wait_for_actors,
)


def _config(*overrides: str):
    return parse_config(["--config", "experiments/quickstart.yaml", "--output_dir", "/tmp/unused", *overrides])


def test_role_resources_as_ray_names_them():
    r = RoleResources(num_cpus=4, num_gpus=1, accelerator_type="H100", resources={"learner_node": 1})
    assert r.ray_resources() == {"CPU": 4.0, "GPU": 1.0, "accelerator_type:H100": 0.001, "learner_node": 1.0}
    opts = r.actor_options("learner")
    assert opts["num_cpus"] == 4 and opts["num_gpus"] == 1 and opts["accelerator_type"] == "H100"
    assert opts["resources"] == {"learner_node": 1.0}
    assert "runtime_env" not in opts  # a learner keeps whatever platform it finds

    # env actors never open an accelerator; memory settings of a server become its JAX environment
    assert RoleResources().actor_options("envs")["runtime_env"] == {"env_vars": {"JAX_PLATFORMS": "cpu"}}
    srv = RoleResources(num_gpus=0.5, memory_fraction=0.4, preallocate=False, env={"XLA_FLAGS": "--x"})
    assert srv.actor_options("servers")["runtime_env"]["env_vars"] == {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.4",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "XLA_FLAGS": "--x",
    }
    tpu = RoleResources(tpu_chips=4)
    assert tpu.ray_resources() == {"TPU": 4.0} and tpu.actor_options("servers")["resources"] == {"TPU": 4.0}


def test_bad_requests_are_refused_with_their_field():
    with pytest.raises(ValueError, match="memory_fraction"):
        RoleResources(memory_fraction=1.5)
    with pytest.raises(ValueError, match="strategy"):
        RoleResources(strategy="EVERYWHERE")
    with pytest.raises(ValueError, match="tpu_version and tpu_topology"):
        RoleResources(tpu_version="v4")
    with pytest.raises(ValueError, match="explicit placement.learner.memory_fraction"):
        PlacementConfig(learner=RoleResources(num_gpus=1), colocate=True)
    with pytest.raises(ValueError, match="> 1"):
        PlacementConfig(
            learner=RoleResources(num_gpus=1, memory_fraction=0.7),
            servers=RoleResources(memory_fraction=0.5),
            colocate=True,
        )
    with pytest.raises(ValueError, match="only one process can open the chips"):
        PlacementConfig(learner=RoleResources(tpu_chips=4), colocate=True)


def test_cpu_affinity_pins_every_thread_of_a_process_that_imports_marin_rl():
    pinned = RoleResources(cpu_affinity=[0]).actor_options("learner")["runtime_env"]["env_vars"]
    assert pinned == {"MARIN_RL_CPU_AFFINITY": "0"}
    with pytest.raises(ValueError, match="cpu_affinity"):
        RoleResources(cpu_affinity=[])
    # a thread that exists before the import is pinned too, and importing JAX afterwards changes nothing
    script = (
        "import os, threading, time\n"
        "t = threading.Thread(target=time.sleep, args=(3,), daemon=True); t.start()\n"
        "import marin_rl, jax\n"
        "print(sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(t.native_id)), os.cpu_count())\n"
    )
    env = {**os.environ, "MARIN_RL_CPU_AFFINITY": "0"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split("]")[:2] == ["[0", " [0"], out.stdout
    bad = subprocess.run(
        [sys.executable, "-c", "import marin_rl"],
        capture_output=True,
        text=True,
        env={**os.environ, "MARIN_RL_CPU_AFFINITY": "0,999"},
    )
    assert bad.returncode != 0 and "this machine has cores" in bad.stderr


@pytest.mark.parametrize(
    "version, topology, hosts, chips_per_host",
    [("v4", "2x2x4", 4, 4), ("v4", "2x2x1", 1, 4), ("v5litepod", "4x4", 4, 4), ("v6e", "4x4", 4, 4)],
)
def test_tpu_slice_maps_to_hosts_and_chips(version, topology, hosts, chips_per_host):
    assert tpu_slice_shape(version, topology) == (hosts, chips_per_host)


def test_tpu_pod_config_maps_to_one_learner_process_per_host():
    config = parse_config(["--config", "experiments/tpu_v4_32.yaml", "--output_dir", "/tmp/unused"])
    lr = config.placement.learner
    assert (lr.tpu_version, lr.tpu_topology, config.learner.hosts) == ("v4", "2x2x4", 4)
    launcher = Launcher(config)
    request = launcher._learner_request()
    assert request.ray_resources()["TPU"] == 4.0  # each learner process holds all of its host's chips
    # a v4-32's four hosts, as Ray reports them, can take it; a v4-8 (one host) cannot
    host = {"Alive": True, "NodeManagerAddress": "10.0.0.{i}", "Resources": {"CPU": 240.0, "TPU": 4.0}}
    check_feasible({"learner": (request, 4)}, [dict(host, NodeManagerAddress=f"10.0.0.{i}") for i in range(4)])
    with pytest.raises(PlacementError, match="TPU: 16 needed, 4 in the cluster"):
        check_feasible({"learner": (request, 4)}, [host])
    # the hosts count must match the slice
    with pytest.raises(SystemExit, match="set learner.hosts: 4"):
        parse_config(["--config", "experiments/tpu_v4_32.yaml", "--output_dir", "/tmp/unused", "--learner.hosts", "2"])


def test_infeasible_request_names_role_request_and_cluster():
    nodes = [{"Alive": True, "NodeManagerAddress": "127.0.0.1", "Resources": {"CPU": 2.0, "memory": 1e9}}]
    with pytest.raises(PlacementError) as e:
        check_feasible({"servers": (RoleResources(num_gpus=1), 1), "envs": (RoleResources(), 2)}, nodes)
    msg = str(e.value)
    assert "placement.servers" in msg and "GPU: 1" in msg and "127.0.0.1 {CPU: 2}" in msg
    with pytest.raises(PlacementError, match="CPU: 3 needed, 2 in the cluster"):
        check_feasible({"learner": (RoleResources(num_cpus=1), 1), "servers": (RoleResources(num_cpus=2), 1)}, nodes)


def test_a_resource_lost_with_its_node_is_named_with_the_node():
    head = {"Alive": True, "NodeID": "aa11", "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8.0, "learner": 1}}
    lost = {"Alive": False, "NodeID": "bb22", "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 8.0, "rollout": 1}}
    envs = RoleResources(num_cpus=1, resources={"rollout": 0.1})
    message = lost_placement("envs", envs, [head, lost])
    assert message == (
        "placement.envs: no live node offers {rollout: 0.1} (each of its processes asks for {CPU: 1, rollout: 0.1}) "
        "any more; the dead node 10.0.0.2 (node id bb22) offered it"
    )
    # a live node offers it (even if others hold it now): nothing is lost, the wait goes on
    assert lost_placement("envs", envs, [head, dict(lost, Alive=True)]) is None
    assert lost_placement("learner", RoleResources(resources={"learner": 1}), [head, lost]) is None
    # every resource exists somewhere alive, but no live node has them all
    both = RoleResources(resources={"learner": 1, "rollout": 1})
    split = [head, dict(lost, Alive=True), dict(lost, NodeID="cc33", NodeManagerAddress="10.0.0.3")]
    message = lost_placement("servers", both, split)
    assert message.startswith("placement.servers: no live node offers {learner: 1, rollout: 1} any more; ")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, resources={"rollout_node": 1}, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.exclusive  # the refusal's wall-clock bound
def test_run_without_the_requested_gpu_fails_fast(local_ray):
    config = _config("--placement.servers.num_gpus", "1")
    start = time.time()
    with pytest.raises(PlacementError, match=r"placement.servers: .*GPU: 1.*the cluster has: .*CPU: 2"):
        Launcher(config).check()
    assert time.time() - start < 5


@pytest.mark.exclusive  # the wait timeout's wall-clock bound
def test_pending_actors_fail_after_the_wait_timeout(local_ray):
    @ray.remote
    class Holder:
        def ready(self):
            return os.getpid()

    holder = Holder.options(resources={"rollout_node": 1}).remote()  # holds the only rollout_node
    ray.get(holder.ready.remote())
    waiting = Holder.options(resources={"rollout_node": 1}).remote()
    start = time.time()
    with pytest.raises(PlacementError, match=r"envs still pending after 2s.*rollout_node: 1"):
        request = {"envs": RoleResources(resources={"rollout_node": 1})}
        wait_for_actors({"envs": [(waiting, waiting.ready.remote())]}, request, 2)
    assert time.time() - start < 10
    ray.kill(waiting)
    ray.kill(holder)


@pytest.mark.exclusive  # the limits' wall-clock bounds
def test_placement_and_start_up_have_their_own_limits(local_ray):
    @ray.remote(max_concurrency=2)  # as the run's actors: answers `__ray_ready__` while it starts
    class SlowStart:
        def start(self, seconds: float) -> str:
            time.sleep(seconds)
            return "serving"

    request = {"servers": RoleResources()}
    startup = {"servers": (10.0, "inference.startup_timeout_s")}
    # placed (its process up) before the wait; a start-up longer than the placement wait is within its own limit
    a, b = SlowStart.remote(), SlowStart.remote()
    ray.get([a.__ray_ready__.remote(), b.__ray_ready__.remote()])
    assert wait_for_actors({"servers": [(a, a.start.remote(3.0))]}, request, 1.0, startup) == {"servers": ["serving"]}
    startup = {"servers": (1.0, "inference.startup_timeout_s")}
    with pytest.raises(PlacementError, match=r"servers \(inference.startup_timeout_s=1s\) placed but not started"):
        wait_for_actors({"servers": [(b, b.start.remote(5.0))]}, request, 10.0, startup)
    # a resource no live node has: the wait ends naming it
    c = SlowStart.options(resources={"gone_node": 1}).remote()
    start = time.time()
    with pytest.raises(PlacementError, match=r"placement.envs: no live node offers \{gone_node: 1\} any more; "):
        wait_for_actors({"envs": [(c, c.start.remote(0.0))]}, {"envs": RoleResources(resources={"gone_node": 1})}, 1)
    assert time.time() - start < 5
    for actor in (a, b, c):
        ray.kill(actor)


def test_colocated_learner_and_server_share_one_bundle(local_ray):
    config = _config(
        "--placement.colocate",
        "true",
        "--placement.learner.num_cpus",
        "1",
        "--placement.learner.memory_fraction",
        "0.6",
        "--placement.servers.memory_fraction",
        "0.3",
    )
    launcher = Launcher(config)
    launcher.check()
    launcher.reserve()
    try:

        @ray.remote
        class Probe:
            def where(self):
                ctx = ray.get_runtime_context()
                return ctx.get_node_id(), os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), ctx.get_assigned_resources()

        learner = Probe.options(**launcher.learner_options(0)).remote()
        server = Probe.options(**launcher.server_options(0)).remote()
        (l_node, l_frac, l_res), (s_node, s_frac, s_res) = ray.get([learner.where.remote(), server.where.remote()])
        assert l_node == s_node
        assert (l_frac, s_frac) == ("0.6", "0.3")
        assert l_res["CPU"] == pytest.approx(0.5) and s_res["CPU"] == pytest.approx(0.5)  # half of the bundle each
        group = launcher.groups["learner"]
        assert group.bundle_specs == [{"CPU": 1.0}]
        ray.kill(learner)
        ray.kill(server)
    finally:
        launcher.release()
