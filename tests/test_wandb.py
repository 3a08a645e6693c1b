"""Weights & Biases for real, offline: a run's W&B directory holds its metrics and config, and a resumed run continues
the same W&B run id."""

import json
import struct
import time
from pathlib import Path

import pytest

from marin_rl.learner.config import LearnerConfig, SftConfig
from marin_rl.learner.optimizer import OptimizerConfig
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.replay.batcher import BatcherConfig
from marin_rl.run import RunConfig, run
from marin_rl.tracking import WANDB_ID_FILE, make_tracker

pytest.importorskip("wandb")


def wandb_records(path: Path) -> list:
    """The records of an offline run's `run-ID.wandb` file (W&B's LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"not a W&B run file: {path}"
    block, pos, chunk, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            pos += left - 7
            continue
        chunk += data[pos : pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def _finished_records(path: Path, timeout_s: float = 60.0) -> list:
    """The records of a run file once it holds the run's exit record: W&B's service may still be writing the file
    when `run.finish()` has returned (seen with wandb 0.31: a 7-byte file for a moment, complete shortly after)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def offline_runs(output_dir: Path) -> list[dict]:
    """Each offline run under `output_dir/wandb`: its id, logged history rows and config keys."""
    runs = []
    for run_dir in sorted((output_dir / "wandb").glob("offline-run-*")):
        [file] = run_dir.glob("run-*.wandb")
        out = {"id": None, "history": [], "config": {}}
        for r in _finished_records(file):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                out["id"] = r.run.run_id
            elif kind == "history":
                out["history"].append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                )
            elif kind == "config":
                out["config"].update({i.key or "/".join(i.nested_key): i.value_json for i in r.config.update})
        runs.append(out)
    return runs


@pytest.mark.gate_run  # a run's metrics through W&B, offline (seconds)
def test_offline_run_records_metrics_and_config(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "completion": str(2 * a)}) + "\n" for a in range(40)))
    out = tmp_path / "run"
    config = RunConfig(
        output_dir=str(out),
        model=ModelConfig(architecture=tiny_llama()),
        batcher=BatcherConfig(max_seq_len=32),
        learner=LearnerConfig(
            mode="sft",
            sft=SftConfig(
                train_files=[str(train)],
                steps=6,
                batch_rows=4,
                eval_every=3,
                log_every=2,
                optimizer=OptimizerConfig(learning_rate=3e-3),
            ),
        ),
    )
    config.tracking.wandb_mode = "offline"
    run(config)
    [found] = offline_runs(out)
    assert found["id"] == (out / WANDB_ID_FILE).read_text().strip()
    losses = [row["sft/loss"] for row in found["history"] if "sft/loss" in row]
    jsonl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses and losses == [row["sft/loss"] for row in jsonl if "sft/loss" in row]
    assert {"learner", "model", "tracking"} <= set(found["config"]), sorted(found["config"])


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path):
    out = tmp_path / "run"
    tracker, _ = make_tracker(str(out), "offline", "marin_rl_test", "resume")
    tracker.log_hyperparameters({"lr": 0.1})
    for step in range(3):
        tracker.log({"loss": 1.0 / (step + 1)}, step=step)
    tracker.finish()
    resumed, _ = make_tracker(str(out), "offline", "marin_rl_test", "resume", resume_step=2, resume_path="ckpt")
    resumed.log({"loss": 0.1}, step=3)
    resumed.finish()
    first, second = offline_runs(out)
    assert first["id"] == second["id"] == (out / WANDB_ID_FILE).read_text().strip()
    assert [r["loss"] for r in first["history"]] == [1.0, 0.5, 1.0 / 3] and first["config"] == {"lr": "0.1"}
    assert [r["loss"] for r in second["history"]] == [0.1] and second["history"][0]["_step"] == 3

    fresh_dir = tmp_path / "fresh"
    fresh, _ = make_tracker(str(fresh_dir), "offline", "marin_rl_test", "fresh")
    fresh.finish()
    [third] = offline_runs(fresh_dir)
    assert third["id"] != first["id"], "a new run (not resumed) starts a new W&B run"
