"""End to end on the vLLM backend: the orchestrator starts `vllm serve` as its server, trains, and broadcasts."""

import json

import pytest

from marin_rl.frozen import thaw
from marin_rl.inference.vllm_env import ensure_vllm_env
from marin_rl.run import parse_config, run


@pytest.mark.slow
def test_run_on_the_vllm_backend(tmp_path):
    ensure_vllm_env(quiet=True)  # created once per machine (minutes), cached outside the checkout afterwards
    out = tmp_path / "run"
    config = thaw(
        parse_config(
            [
                "--config",
                "experiments/quickstart.yaml",
                "--output_dir",
                str(out),
                "--inference.backend",
                "vllm",
                "--inference.vllm.enforce_eager",
                "true",
                "--orchestrator.num_steps",
                "4",
                "--orchestrator.eval_every",
                "4",
                "--orchestrator.num_cpus",
                "2",
                "--learner.warm_start.steps",
                "30",
                "--checkpoint.every",
                "0",
            ]
        )
    )  # changed below
    config.envs[0].num_eval_problems = 16
    summary = run(config)
    assert summary["steps"] == 4

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "learner/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    # Every trained token carried the version vLLM reported for it. Servers that never took the learner's updates
    # would leave version-0 tokens, too old (lag > replay.max_age) to train on by step 4.
    for r in steps:
        assert 0 <= r["batches/staleness/max"] <= config.replay.max_age
        assert r["broadcast/bytes"] > 0
        if r["batches/staleness/max"] == 0:  # on-policy: vLLM's logprobs equal the learner's token by token
            assert r["learner/logprob_diff_sampler/max_abs"] < 1e-4
    assert steps[0]["batches/staleness/max"] == 0
    assert (out / "hf" / "step-4" / "config.json").exists()
