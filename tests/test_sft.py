"""Supervised fine-tuning (`learner.mode: sft`): data, packing, the loss against NumPy, training, export, sharding."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import haliax as hax
import numpy as np
import pytest
from subprocess_env import subprocess_env

from marin_rl.config import RunConfig
from marin_rl.envs.data import DataFormatError
from marin_rl.learner.config import LearnerConfig, SftConfig
from marin_rl.learner.learner import Learner
from marin_rl.learner.optimizer import OptimizerConfig
from marin_rl.model.build import build_model
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.model.logprobs import packed_attention_mask
from marin_rl.programs.sft import SftTrainer, build_batch, encode_records, load_records, plan_batches
from marin_rl.replay.batcher import BatcherConfig
from marin_rl.replay.packing import Sequence, pack
from marin_rl.run import parse_config, run
from marin_rl.tokenizer import build_char_tokenizer

SEQ = 32


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _doubling(n: int) -> list[dict[str, str]]:
    return [{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in range(n)]


def _config(tmp_path, train_files, **sft) -> RunConfig:
    defaults = dict(steps=40, batch_rows=4, optimizer=OptimizerConfig(learning_rate=3e-3), eval_every=20, log_every=20)
    return RunConfig(
        output_dir=str(tmp_path / "run"),
        model=ModelConfig(architecture=tiny_llama()),
        batcher=BatcherConfig(max_seq_len=SEQ),
        learner=LearnerConfig(mode="sft", sft=SftConfig(train_files=train_files, **{**defaults, **sft})),
    )


def _logits(model, batch) -> np.ndarray:
    axes = (hax.Axis("batch", batch.num_rows), hax.Axis("position", batch.seq_len))
    ids, pos, seg = (hax.named(x, axes) for x in (batch.input_ids, batch.position_ids, batch.segment_ids))
    out = model(ids, attn_mask=packed_attention_mask(seg), pos_ids=pos)
    return np.asarray(out.rearrange((*axes, model.Vocab)).array)


# ---- data ---------------------------------------------------------------------------------------------------------
def test_records_are_read_and_encoded_with_the_loss_on_the_completion(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"q": "12+7=", "a": "19", "id": 3}, {"q": "1+1=", "a": "2"}])
    records = load_records([path], "q", "a")
    assert [(p, c) for _, p, c in records] == [("12+7=", "19"), ("1+1=", "2")]
    (p, c), _ = encode_records(records, tokenizer, chat_template=False, append_eos=True)
    assert tokenizer.decode(p) == "12+7=" and tokenizer.decode(c[:-1]) == "19" and c[-1] == tokenizer.eos_token_id
    seq = Sequence.supervised(p, c)
    assert seq.loss_mask.tolist() == [False] * len(p) + [True] * len(c)

    # the chat template: a user turn with the generation prompt, then the assistant's answer and end of turn
    (p, c), _ = encode_records(records, tokenizer, chat_template=True, append_eos=True)
    assert tokenizer.decode(p) == "<|user|>12+7=<eos><|assistant|>"
    assert tokenizer.decode(c) == "19<eos>"


def test_bad_records_name_the_file_line_and_field(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2="}])
    with pytest.raises(DataFormatError, match=r"bad.jsonl:2: field 'completion': missing"):
        load_records([path], "prompt", "completion")
    path = _write_jsonl(tmp_path / "num.jsonl", [{"prompt": "1+1=", "completion": 2}])
    with pytest.raises(DataFormatError, match=r"num.jsonl:1: field 'completion': expected a string, got int 2"):
        load_records([path], "prompt", "completion")
    with pytest.raises(DataFormatError, match="no such file"):
        load_records([str(tmp_path / "missing.jsonl")], "prompt", "completion")


def test_batch_plan_packs_every_record_once_per_epoch():
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(3, 30, size=200)]
    plan = plan_batches(lengths, 4, SEQ, epochs=2, seed=1)
    seen = [i for batch in plan for i, _ in batch]
    assert sorted(seen) == sorted(list(range(200)) * 2)
    first = [i for batch in plan[: len(plan) // 2] for i, _ in batch]
    assert sorted(first) == list(range(200)), "a batch never mixes two epochs"
    for batch in plan:
        fill = np.zeros(4, int)
        for i, r in batch:
            fill[r] += lengths[i]
        assert (fill <= SEQ).all()
    full = [sum(lengths[i] for i, _ in b) / (4 * SEQ) for b in plan]
    assert np.median(full) > 0.9 and np.mean(full) > 0.85, "rows are filled like the RL batcher's"
    assert len(plan_batches(lengths, 4, SEQ, steps=7, seed=1)) == 7
    with pytest.raises(ValueError, match="longer than the row length"):
        plan_batches([SEQ + 1], 4, SEQ)


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="learner.mode must be one of"):
        LearnerConfig(mode="supervised")
    with pytest.raises(ValueError, match="learner.sft.train_files must name at least one file"):
        LearnerConfig(mode="sft")
    with pytest.raises(ValueError, match="learner.sft.batch_rows: must be >= 1"):
        SftConfig(batch_rows=0)
    with pytest.raises(ValueError, match=r"learner.sft.eval_fraction: must be in \(0, 1\)"):
        SftConfig(eval_fraction=1.0)
    with pytest.raises(ValueError, match="learner.sft.steps: must be >= 0"):
        SftConfig(steps=-1)
    with pytest.raises(ValueError, match="learner.sft.train_files must be a list"):
        SftConfig(train_files="data.jsonl")
    with pytest.raises(SystemExit, match="learner.sft.train_files"):
        parse_config(["--config", "experiments/sft_addition.yaml", "--learner.sft.train_files", "[]"])
    config = parse_config(["--config", "experiments/sft_addition.yaml", "--output_dir", str(tmp_path)])
    assert config.learner.mode == "sft" and config.learner.sft.train_files == ["runs/data/addition_sft.jsonl"]


# ---- the loss -----------------------------------------------------------------------------------------------------
def test_supervised_loss_equals_a_numpy_reference(tokenizer):
    """Several records packed per row vs each record alone in its own row, log-softmax in float64 NumPy."""
    learner = Learner(ModelConfig(architecture=tiny_llama(), seed=5), LearnerConfig(), len(tokenizer))
    records = [("12+30=", "42"), ("Hello, ", "world!"), ("a", "bcdef"), ("x*y", "=z"), ("7", "77")]
    examples = [(tokenizer(p)["input_ids"], tokenizer(c)["input_ids"]) for p, c in records]
    seqs = [Sequence.supervised(p, c) for p, c in examples]
    batch, placed = pack(seqs, 2, SEQ, assignment=[0, 0, 1, 1, 1])
    assert len(placed) == len(seqs) and batch.segment_ids.max(axis=1).tolist() == [1, 2], "several records per row"

    nll = []
    for p, c in examples:
        alone, _ = pack([Sequence.supervised(p, c)], 1, len(p) + len(c))
        logits = _logits(learner.model, alone)[0].astype(np.float64)
        log_softmax = logits - logits.max(-1, keepdims=True)
        log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
        ids = list(p) + list(c)
        nll += [-log_softmax[t - 1, ids[t]] for t in range(len(p), len(ids))]
    expected = float(np.mean(nll))

    total, count = learner.supervised_nll(batch)
    assert count == len(nll) == sum(len(c) for _, c in examples)
    np.testing.assert_allclose(total / count, expected, rtol=1e-5)

    optimizer = OptimizerConfig(learning_rate=1e-2).build()
    state = learner.supervised_optimizer_state(optimizer)
    state, metrics = learner.supervised_step(batch, optimizer, state)
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5)  # the loss before the update
    assert int(metrics["tokens"]) == count and float(metrics["grad_norm"]) > 0
    after, _ = learner.supervised_nll(batch)
    assert after < total, "the step lowers the loss it was taken on"
    assert learner.version == 0, "supervised steps make no policy versions"


# ---- training, evaluation and export ------------------------------------------------------------------------------
def test_sft_lowers_held_out_loss_and_the_export_reloads_identically(tmp_path, tokenizer):
    train = _write_jsonl(tmp_path / "train.jsonl", _doubling(80))
    held_out = _write_jsonl(
        tmp_path / "eval.jsonl", [{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in (81, 90, 99)]
    )
    config = _config(tmp_path, [train], eval_files=[held_out])
    config.model = dataclasses.replace(config.model, export_every=20)
    trainer = SftTrainer(config)
    summary = trainer.train()

    assert summary["steps"] == 40 and summary["eval_records"] == 3 and summary["train_records"] == 80
    assert summary["eval_loss_end"] < 0.4 * summary["eval_loss_start"], summary
    out = tmp_path / "run"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "sft/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 41))
    assert [r["step"] for r in rows if "sft/eval_loss" in r] == [0, 20, 40]
    assert np.mean([r["sft/loss"] for r in steps[-5:]]) < 0.5 * np.mean([r["sft/loss"] for r in steps[:5]])
    assert json.loads((out / "summary.json").read_text())["eval_loss_end"] == summary["eval_loss_end"]
    assert summary["final_checkpoint"] == str(out / "hf" / "step-40")
    assert (out / "hf" / "step-20" / "config.json").is_file(), "exported every model.export_every steps"

    # the export is the trained policy: a run initialised from it computes identical logits
    reloaded = build_model(dataclasses.replace(config.model, init_from_hf=summary["final_checkpoint"]), len(tokenizer))
    batch = build_batch(trainer.eval_seqs, trainer.eval_plan[0], 4, SEQ)
    np.testing.assert_allclose(_logits(reloaded, batch), _logits(trainer.learner.model, batch), rtol=1e-6, atol=1e-6)


def test_held_out_split_and_epochs_from_the_training_files(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", _doubling(60))
    trainer = SftTrainer(_config(tmp_path, [train], steps=0, epochs=2, eval_fraction=0.1))
    assert len(trainer.eval_seqs) == 6 and len(trainer.train_seqs) == 54
    held_out = {tuple(s.token_ids) for s in trainer.eval_seqs}
    assert not held_out & {tuple(s.token_ids) for s in trainer.train_seqs}, "held-out records are never trained on"
    trained = sorted(i for batch in trainer.plan for i, _ in batch)
    assert trained == sorted(list(range(54)) * 2)


# ---- sharding -----------------------------------------------------------------------------------------------------
WORKER = r"""
import json, sys
import jax
from marin_rl.config import RunConfig
from marin_rl.learner.config import LearnerConfig, MeshConfig, SftConfig
from marin_rl.learner.optimizer import OptimizerConfig
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.programs.sft import SftTrainer
from marin_rl.replay.batcher import BatcherConfig

assert jax.device_count() == 4, jax.devices()
data, out = sys.argv[1], sys.argv[2]


def config(name, mesh, **sft):
    return RunConfig(
        output_dir=f"{out}/{name}",
        model=ModelConfig(architecture=tiny_llama()),
        batcher=BatcherConfig(max_seq_len=32),
        learner=LearnerConfig(mode="sft", sft=SftConfig(train_files=[data], **sft), mesh=mesh),
    )


results = {}
meshes = {"one": MeshConfig(data=1), "dp4": MeshConfig(data=4), "fsdp_tp": MeshConfig(data=1, fsdp=2, tensor=2)}
for name, mesh in meshes.items():
    opt = OptimizerConfig(learning_rate=3e-3)
    trainer = SftTrainer(config(name, mesh, steps=3, batch_rows=8, eval_every=1, optimizer=opt))
    trainer.train()
    rows = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl")]
    results[name] = {
        "mesh": None if trainer.learner.mesh is None else dict(trainer.learner.mesh.shape),
        "loss": [r["sft/loss"] for r in rows if "sft/loss" in r],
        "eval": [r["sft/eval_loss"] for r in rows if "sft/eval_loss" in r],
        "grad_norm": [r["sft/grad_norm"] for r in rows if "sft/grad_norm" in r],
    }
try:  # 6 rows do not split over 4 data shards: a clear error before any training
    SftTrainer(config("bad", MeshConfig(data=4), batch_rows=6))
    results["rows_error"] = None
except ValueError as e:
    results["rows_error"] = str(e)
print("RESULT " + json.dumps(results))
"""


def test_sharded_sft_matches_one_device(tmp_path):
    data = _write_jsonl(tmp_path / "train.jsonl", _doubling(100))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, data, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    results = json.loads(proc.stdout.split("RESULT ", 1)[1])
    one = results["one"]
    assert one["mesh"] is None and len(one["loss"]) == 3 and len(one["eval"]) == 4
    assert one["loss"][-1] < one["loss"][0]
    assert results["dp4"]["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
    assert results["fsdp_tp"]["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2}
    assert "learner.sft.batch_rows=6 does not split over the learner mesh's 4 batch shards" in results["rows_error"]
    for name in ("dp4", "fsdp_tp"):
        for key in ("loss", "eval", "grad_norm"):
            np.testing.assert_allclose(results[name][key], one[key], rtol=1e-5, err_msg=f"{name} {key}")


# ---- the example: supervised run, then an RL run from its export --------------------------------------------------
@pytest.mark.slow
def test_sft_addition_example_then_rl_from_its_export(tmp_path):
    data = tmp_path / "addition_sft.jsonl"
    subprocess.run(
        [sys.executable, "experiments/addition_sft_data.py", str(data)],
        check=True,
        capture_output=True,
        env=subprocess_env(),
    )
    sft = parse_config(
        ["--config", "experiments/sft_addition.yaml", "--output_dir", str(tmp_path / "sft")]
        + ["--learner.sft.train_files", f"[{data}]", "--learner.sft.steps", "150", "--learner.sft.eval_every", "50"]
    )
    summary = run(sft)  # dispatched to supervised fine-tuning by learner.mode
    assert summary["mode"] == "sft" and summary["steps"] == 150
    assert summary["eval_loss_end"] < 0.3 * summary["eval_loss_start"], summary
    rl = parse_config(
        ["--config", "experiments/quickstart.yaml", "--output_dir", str(tmp_path / "rl")]
        + ["--model.init_from_hf", summary["final_checkpoint"], "--learner.warm_start.steps", "0"]
        + ["--orchestrator.num_steps", "10", "--orchestrator.eval_every", "10", "--orchestrator.num_cpus", "2"]
    )
    result = run(rl)
    # A random policy answers none of the held-out sums (reward 0); after 150 supervised steps on demonstrations that
    # slip 40% of the time the policy gets 0.15-0.35 of them right at temperature 1 (0.1475 seen on one machine).
    assert result["steps"] == 10 and result["eval_reward_start"] >= 0.08, result
