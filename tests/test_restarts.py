"""The restart bound per role: replacements up to `orchestrator.max_restarts_per_role` go through, the next one
stops the run with an error that names the role, the limit and the way back. How a replacement is awaited: a bounded
wait to be placed that names a resource no live node offers, and no waiting at all for one whose constructor raises."""

import time

import pytest

from marin_rl.config import parse_config
from marin_rl.orchestrator.restarts import RestartBudget, RestartLimitExceeded, start_replacement
from marin_rl.placement import PlacementError, RoleResources


def test_the_replacement_past_the_limit_raises_and_names_role_limit_and_resume():
    budget = RestartBudget("env actors of addition", 2)
    budget.spend("env actor addition/0")
    budget.spend("env actor addition/1")
    assert budget.spent == 2
    with pytest.raises(RestartLimitExceeded) as e:
        budget.spend("env actor addition/0")
    message = str(e.value)
    assert "env actor addition/0 died" in message and "env actors of addition were already replaced 2 times" in message
    assert "orchestrator.max_restarts_per_role=2" in message and "resumes from the latest checkpoint" in message
    assert budget.spent == 2


def test_zero_means_a_dead_actor_ends_the_run_and_negative_is_refused():
    with pytest.raises(RestartLimitExceeded):
        RestartBudget("inference servers", 0).spend("inference server 0")
    with pytest.raises(SystemExit, match="orchestrator.max_restarts_per_role: must be >= 0"):
        parse_config(["--config", "experiments/quickstart.yaml", "--orchestrator.max_restarts_per_role", "-1"])


@pytest.mark.exclusive  # the waits' wall-clock bounds
def test_a_replacement_fails_at_once_when_it_cannot_be_built_and_after_the_wait_when_it_cannot_be_placed():
    import ray
    from ray.exceptions import RayActorError

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote(num_cpus=0)
        class Replica:
            def __init__(self, broken: bool = False):
                if broken:
                    raise ValueError("no training problems")

            def ready(self) -> str:
                return "ready"

        def ready(actor):
            return actor.ready.remote()

        actor, answer = start_replacement("env actor a/0", "envs", Replica.remote, ready, RoleResources(), 60)
        assert answer == "ready"
        start = time.time()
        with pytest.raises(RayActorError, match="no training problems"):  # not started again until the wait ends
            start_replacement("env actor a/0", "envs", lambda: Replica.remote(True), ready, RoleResources(), 60)
        assert time.time() - start < 20
        spawned = []

        def spawn_on_a_lost_node():
            spawned.append(Replica.options(resources={"gone_node": 1}).remote())
            return spawned[-1]

        start = time.time()
        with pytest.raises(PlacementError, match=r"placement.envs: no live node offers \{gone_node: 1\} any more"):
            start_replacement(
                "env actor a/0", "envs", spawn_on_a_lost_node, ready, RoleResources(resources={"gone_node": 1}), 2
            )
        assert 2 <= time.time() - start < 10 and len(spawned) == 1
        with pytest.raises(RayActorError):  # the pending replacement was killed: nothing waits for it at shutdown
            ray.get(spawned[0].ready.remote(), timeout=10)
        ray.kill(actor)
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_a_run_whose_env_actor_keeps_dying_stops_at_the_bound_and_leaves_nothing(tmp_path):
    """A live run with `max_restarts_per_role: 1`: the env actor killed after step 2 is replaced (and counted in
    the step metrics); killed again after step 4, the run stops with the bound's error and shuts everything down."""
    import json

    import ray
    from marked_processes import MarkedRun

    from marin_rl.orchestrator.hooks import StepHook
    from marin_rl.orchestrator.orchestrator import Orchestrator

    out = tmp_path / "run"
    config = parse_config(
        [
            "--config",
            "experiments/quickstart.yaml",
            "--output_dir",
            str(out),
            "--orchestrator.num_steps",
            "30",
            "--orchestrator.eval_every",
            "1000",
            "--orchestrator.num_cpus",
            "2",
            "--learner.warm_start.steps",
            "10",
            "--orchestrator.max_restarts_per_role",
            "1",
            "--checkpoint.save_on_exit",
            "false",
        ]
    )
    orchestrator = Orchestrator(config)
    killed = []

    def kill_env_actor(step: int) -> None:
        if step in (2, 4):
            ray.kill(orchestrator.pools["addition"].actors[0])
            killed.append(step)

    orchestrator.hooks.hooks.append(StepHook("kill_env_actor", 1, kill_env_actor))
    # every process the run starts carries a mark: what it leaves is checked while other tests run beside it
    with (
        MarkedRun() as marked,
        pytest.raises(RestartLimitExceeded, match="env actors of addition were already replaced 1 times"),
    ):
        orchestrator.run()
    assert killed == [2, 4]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    restarts = [r["envs/addition/actor_restarts"] for r in rows if "envs/addition/actor_restarts" in r]
    assert restarts[:2] == [0.0, 0.0] and restarts[-1] == 1.0, restarts
    assert max(r["step"] for r in rows if "learner/loss" in r) < 30, "the run stopped at the bound"

    marked.assert_all_exited(30)  # and shut everything down on its way out
    assert orchestrator.parts._watchdog is None, "the watcher is stopped with the run"
