"""experiments/smollm2_math.yaml: a released model (SmolLM2-135M-Instruct, from its GGUF file through
`model.init_from_hf`) learns. The recipe shortened to its first 4 RL steps must already raise held-out reward by the
issue's bar, 0.15 (the full recipe: 0.107 -> 0.866 in 20 steps, benchmarks/RESULTS.md); the data it trains on are what
their script writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "experiments" / "data" / "small_sums"


def test_the_shipped_sums_are_what_the_script_writes_and_hold_out_unordered_pairs(tmp_path):
    from test_gsm8k_recipe import assert_the_script_writes_the_shipped_data

    assert_the_script_writes_the_shipped_data("small_sums.py", DATA, tmp_path)
    read = lambda name: [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines()]
    rows = {name: read(name) for name in ("train", "test")}
    pairs = {name: {frozenset(r["question"].split(" + ")) for r in rs} for name, rs in rows.items()}
    assert not pairs["train"] & pairs["test"]  # '3 + 7' held out means '7 + 3' is too
    assert len(rows["train"]) + len(rows["test"]) == 100
    assert all(int(r["answer"]) == sum(int(x) for x in r["question"].split(" + ")) for rs in rows.values() for r in rs)


@pytest.mark.slow
def test_smollm2_learns_small_sums_in_four_steps(tmp_path):
    from test_gguf import smollm2_file

    out = tmp_path / "run"
    args = [
        "--config",
        str(ROOT / "experiments" / "smollm2_math.yaml"),
        "--output_dir",
        str(out),
        "--model.init_from_hf",
        str(smollm2_file()),
        "--tokenizer.path",
        str(smollm2_file()),
        "--orchestrator.num_steps",
        "4",
    ]
    log = tmp_path / "run.log"
    with open(log, "wb") as f:
        done = subprocess.run(
            [sys.executable, "-m", "marin_rl.run", *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=1200
        )
    assert done.returncode == 0, log.read_text()[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    start, end = summary["eval_reward_start"], summary["eval_reward_end"]
    print(f"SmolLM2 small sums, 4 steps: held-out {start:.3f} -> {end:.3f} in {summary['wall_time_s']:.0f} s")
    assert start < 0.3, "the recipe's starting point moved: its task no longer has the headroom it was chosen for"
    assert end - start >= 0.15, f"held-out reward {start:.3f} -> {end:.3f}"
