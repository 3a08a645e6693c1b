"""`python -m marin_rl.try_env` runs episodes of one env against an embedded server and prints them."""

import subprocess
import sys


def test_try_prints_conversations_and_rewards():
    out = subprocess.run(
        [sys.executable, "-m", "marin_rl.try_env", "addition", "--config", "experiments/quickstart.yaml"]
        + ["--problems", "2", "--group-size", "3", "--held-out"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("[user]") == 6 and out.stdout.count("[assistant*]") == 6
    assert "rewards={'correct'" in out.stdout and ", v0)" in out.stdout
    assert "6 episodes on 2 problems: mean reward" in out.stdout


def test_try_names_unknown_env():
    out = subprocess.run(
        [sys.executable, "-m", "marin_rl.try_env", "nope", "--config", "experiments/quickstart.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "unknown environment 'nope'" in out.stderr
