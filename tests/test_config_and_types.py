"""Configuration parsing and validation; rollout schema round trips and validation errors."""

import subprocess
import sys

import numpy as np
import pytest

from marin_rl.run import parse_config
from marin_rl.types import InferenceMetadata, Rollout, RolloutFormatError, RolloutGroup, Turn

QUICKSTART = "experiments/quickstart.yaml"


def test_quickstart_parses_with_overrides():
    cfg = parse_config(["--config", QUICKSTART, "--orchestrator.num_steps", "7"])
    assert cfg.orchestrator.num_steps == 7
    assert cfg.envs[0].args["max_operand"] == 49
    assert cfg.model.architecture.hidden_dim == 128


def test_unknown_key_names_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("orchestrator:\n  num_stepz: 3\n")
    with pytest.raises(SystemExit, match="num_stepz"):
        parse_config(["--config", str(bad)])


def test_wrong_type_names_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("batcher:\n  max_seq_len: lots\n")
    with pytest.raises(SystemExit, match="batcher.max_seq_len"):
        parse_config(["--config", str(bad)])


def test_cross_field_validation(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("envs:\n  - name: a\n    group_size: 1\n")
    with pytest.raises(SystemExit, match="group_size"):
        parse_config(["--config", str(bad)])


def test_cli_help_lists_fields_and_bad_config_fails_before_starting(tmp_path):
    out = subprocess.run([sys.executable, "-m", "marin_rl.run", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for field in ("--orchestrator.num_steps", "--batcher.total_token_budget", "--learner.loss.clip_high"):
        assert field in out.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("replay:\n  advantage_estimator: ppo\n")
    out = subprocess.run(
        [sys.executable, "-m", "marin_rl.run", "--config", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0 and "advantage estimator" in out.stderr and "ray" not in out.stderr.lower()


def _rollout():
    meta = InferenceMetadata(server="s", version_start=3, version_end=4, finish_reason="length")
    return Rollout(
        environment="e",
        problem_id="p",
        turns=[
            Turn("user", "1+1=", [9, 80, 9, 88]),
            Turn(
                "assistant",
                "2",
                [10, 2],
                sampler_logprobs=[-0.1, -0.2],
                reward=1.0,
                rewards={"c": 1.0},
                inference_metadata=meta,
            ),
        ],
    )


def test_rollout_round_trip_and_token_views():
    r = _rollout()
    back = Rollout.from_dict(r.to_dict())
    assert back == r
    np.testing.assert_array_equal(back.loss_mask(), [0, 0, 0, 0, 1, 1])
    np.testing.assert_array_equal(back.token_versions(), [-1, -1, -1, -1, 3, 3])
    assert back.truncated and back.reward == 1.0 and back.oldest_version == 3
    g = RolloutGroup("e", "p", [r, _rollout()])
    assert RolloutGroup.from_dict(g.to_dict()) == g
    # A turn sampled across a weight update: each token keeps the version that sampled it.
    r.turns[1].inference_metadata.token_versions = [3, 4]
    back = Rollout.from_dict(r.to_dict())
    assert back == r
    np.testing.assert_array_equal(back.token_versions(), [-1, -1, -1, -1, 3, 4])
    assert back.oldest_version == 3


@pytest.mark.parametrize(
    "corrupt,msg",
    [
        (lambda d: d["turns"][1].update(sampler_logprobs=[-0.1]), "logprobs for 2"),
        (lambda d: d["turns"][1].update(sampler_logprobs=[float("nan"), -0.1]), "finite"),
        (lambda d: d["turns"][0].update(role="robot"), "role"),
        (lambda d: d.pop("turns"), "malformed"),
        (lambda d: d["turns"][1].update(inference_metadata=None), "metadata"),
        (lambda d: d["turns"][1]["inference_metadata"].update(token_versions=[3]), "1 token versions for 2"),
        (lambda d: d["turns"][1]["inference_metadata"].update(token_versions=[3, 5]), r"outside \[version_start"),
        (lambda d: d["turns"][0].update(token_ids=[], message=""), "empty prompt"),
        (lambda d: d["turns"].insert(0, {**d["turns"][0], "token_ids": []}), "empty prompt"),
    ],
)
def test_invalid_rollouts_are_reported(corrupt, msg):
    d = _rollout().to_dict()
    corrupt(d)
    with pytest.raises(RolloutFormatError, match=msg):
        Rollout.from_dict(d)
