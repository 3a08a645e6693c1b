"""Every benchmark runs: its `--smoke` mode (seconds, tiny sizes) must finish and print its figure line."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))

FIGURE = {  # the last line each benchmark prints: name=value
    "broadcast": "broadcast_over_memcpy",
    "broadcast_nodes": "cross_node_over_memcpy",
    "chat": "chat_over_completions",
    "colocated": "default_over_local",
    "credit_assignment": "turn_over_group_reward",
    "distillation": "distill_over_rl",
    "inference": "http_over_engine",
    "learner_mfu": "mfu",
    "loop": "loop_over_limit",
    "lora": "lora_bytes_over_full",
    "packing": "packing_efficiency",
    "server_load": "recovery_over_initial",
    "staleness": "async_over_sync",
}


def test_every_benchmark_is_smoke_tested():
    assert set(BENCHMARKS) == set(FIGURE), f"add the new benchmark's figure line to FIGURE: {BENCHMARKS}"


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_smoke_mode_runs_and_prints_its_figure(name):
    # the package from this checkout, whether or not (and from wherever) it is installed
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"benchmarks/{name}.py --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"{FIGURE[name]}=[0-9.]+", last), f"unexpected last line {last!r}"
