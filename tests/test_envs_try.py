"""`python -m marin_rl.try_env` runs episodes of one env against an embedded server and prints them: from random
weights (and says so), or from a saved policy (`--checkpoint`: an HF export, or a run directory's newest one)."""

import json
import subprocess
import sys

import pytest

from marin_rl.programs.try_env import RANDOM_WEIGHTS_LINE, find_policy_checkpoint


def _try(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "marin_rl.try_env", "addition", "--config", "experiments/quickstart.yaml", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_try_prints_conversations_and_rewards_and_says_the_weights_are_random():
    out = _try("--problems", "2", "--group-size", "3", "--held-out")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("[user]") == 6 and out.stdout.count("[assistant*]") == 6
    assert "rewards={'correct'" in out.stdout and ", v0)" in out.stdout
    assert "6 episodes on 2 problems: mean reward" in out.stdout
    assert RANDOM_WEIGHTS_LINE in out.stderr


def test_try_samples_from_a_run_directorys_newest_export(tmp_path):
    from marin_rl.model.build import build_model
    from marin_rl.model.hf import export_hf_checkpoint
    from marin_rl.run import parse_config
    from marin_rl.tokenizer import load_tokenizer

    config = parse_config(["--config", "experiments/quickstart.yaml"])
    tokenizer = load_tokenizer(config.tokenizer)
    export_hf_checkpoint(build_model(config.model, len(tokenizer)), tokenizer, str(tmp_path / "run" / "hf" / "step-7"))
    out = _try("--problems", "1", "--group-size", "2", "--checkpoint", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"policy: the Hugging Face export at {tmp_path / 'run' / 'hf' / 'step-7'} (step 7)" in out.stderr
    assert RANDOM_WEIGHTS_LINE not in out.stderr
    assert "2 episodes on 1 problems: mean reward" in out.stdout


def _export(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")


def _checkpoint(path, step):
    path.mkdir(parents=True)
    (path / "metadata.json").write_text(json.dumps({"step": step, "timestamp": f"2026-01-01T00:00:{step:02d}"}))


def test_checkpoint_resolution_takes_the_newest_of_exports_and_checkpoints(tmp_path):
    run = tmp_path / "run"
    _export(run / "hf" / "step-2")
    _export(run / "hf" / "step-10")
    (run / "hf" / "step-20").mkdir()  # an export still being written: no config.json
    found = find_policy_checkpoint(str(run))
    assert (found.kind, found.path, found.step) == ("hf", str(run / "hf" / "step-10"), 10)
    _checkpoint(run / "checkpoints" / "step-10", 10)  # same step: the export, lighter to load
    assert find_policy_checkpoint(str(run)).kind == "hf"
    _checkpoint(run / "checkpoints" / "step-12", 12)
    found = find_policy_checkpoint(str(run))
    assert (found.kind, found.path, found.step) == ("learner", str(run / "checkpoints" / "step-12"), 12)
    assert find_policy_checkpoint(str(run / "hf" / "step-2")).kind == "hf"  # an export named directly
    with pytest.raises(FileNotFoundError, match="no Hugging Face export"):
        find_policy_checkpoint(str(tmp_path / "empty"))


def test_try_names_unknown_env_and_a_path_without_a_policy(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "marin_rl.try_env", "nope", "--config", "experiments/quickstart.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "unknown environment 'nope'" in out.stderr
    out = _try("--checkpoint", str(tmp_path), timeout=120)
    assert out.returncode != 0 and f"--checkpoint {tmp_path}: no Hugging Face export" in out.stderr
