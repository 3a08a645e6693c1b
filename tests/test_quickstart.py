"""End to end: a shortened quickstart through Ray, the embedded server and the learner; the policy must learn."""

import glob
import json
import os

import pytest
from marked_processes import MarkedRun, slot_owner

from marin_rl.broadcast.shared_memory import PRIVATE_PREFIX
from marin_rl.run import parse_config, run


@pytest.mark.slow  # the gate's Ray run that learns is the LoRA quickstart (tests/README.md)
def test_shortened_quickstart_learns(tmp_path):
    out = tmp_path / "run"
    config = parse_config(
        [
            "--config",
            "experiments/quickstart.yaml",
            "--output_dir",
            str(out),
            "--orchestrator.num_steps",
            "100",
            "--orchestrator.eval_every",
            "50",
            "--orchestrator.num_cpus",
            "2",
        ]
    )
    # every process the run starts carries a mark, so what it leaves is checked while other tests run beside it
    with MarkedRun() as marked:
        summary = run(config)

    # An untrained model answers none of these; the warm start alone is near 0.4 at temperature 1.
    assert summary["eval_reward_end"] >= 0.6, summary
    assert summary["eval_reward_end"] - summary["eval_reward_start"] >= 0.15, summary
    assert summary["steps"] == 100

    assert json.loads((out / "summary.json").read_text())["eval_reward_end"] == summary["eval_reward_end"]
    assert (out / "reward.png").stat().st_size > 10_000
    assert (out / "hf" / "step-100" / "config.json").exists(), "the final policy is exported as an HF checkpoint"
    assert any((out / "rollouts" / "addition").glob("*.parquet")), "accepted rollouts are persisted"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "learner/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 101))
    for r in steps:
        # every trained token carried the version that sampled it: lag is bounded by replay.max_age
        assert 0 <= r["batches/staleness/max"] <= config.replay.max_age
        assert r["learner/ratio/mean"] == 1.0
        if r["batches/staleness/max"] == 0:  # on-policy batch: sampler and learner agree token by token
            assert r["learner/logprob_diff_sampler/max_abs"] < 1e-4
        assert r["batches/packing_efficiency"] > 0.8
    assert steps[0]["batches/staleness/max"] == 0, "the first batch is sampled entirely by version 0"
    # the server's counters are logged with every step (from the previous step's answer)
    served = [r["servers/0/generated_tokens"] for r in steps if "servers/0/generated_tokens" in r]
    assert len(served) >= 90 and served == sorted(served) and served[-1] > 0
    assert all(r["servers/restarts"] == 0 for r in steps)
    evals = [r for r in rows if "eval/addition/reward" in r]
    assert [r["step"] for r in evals] == [0, 50, 100]

    # nothing the run started is left running once run() returns (Ray's processes exit within seconds of shutdown)
    marked.assert_all_exited(30)
    # broadcast.transport 'auto' chose shared memory (one machine); its slots are gone with the run
    assert summary["broadcast_transport"] == "shared_memory"
    owners = marked.seen | {os.getpid()}
    ours = [d for d in glob.glob(f"/dev/shm/{PRIVATE_PREFIX}*") if slot_owner(d, PRIVATE_PREFIX) in owners]
    assert ours == [], f"weight slots of the run left: {ours}"


@pytest.mark.slow
def test_ppo_quickstart_with_critic_and_gae_learns(tmp_path):
    """experiments/quickstart_ppo.yaml, shortened: the critic trains beside the policy (its value loss falls and its
    values track the mean return, the baseline a group estimator would compute) and held-out reward rises."""
    out = tmp_path / "run"
    config = parse_config(
        [
            "--config",
            "experiments/quickstart_ppo.yaml",
            "--output_dir",
            str(out),
            "--orchestrator.num_steps",
            "150",
            "--orchestrator.eval_every",
            "150",
            "--orchestrator.backend",  # PPO's Ray path: test_resume's PPO run, killed and resumed
            "local",
            "--checkpoint.every",
            "0",
        ]
    )
    summary = run(config)
    assert summary["eval_reward_end"] - summary["eval_reward_start"] >= 0.2, summary
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "learner/critic/value_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 151))
    first, last = (sum(r["learner/critic/value_loss"] for r in part) / 20 for part in (steps[:20], steps[-20:]))
    assert last < 0.7 * first, (first, last)
    value, ret = (sum(r[f"learner/critic/{k}"] for r in steps[-20:]) / 20 for k in ("value_mean", "return_mean"))
    assert abs(value - ret) < 0.05, (value, ret)
