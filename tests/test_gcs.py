"""gs:// for real, offline: a local Google Cloud Storage emulator (`gcp-storage-emulator`) behind gcsfs (which honours
`STORAGE_EMULATOR_HOST`) and TensorStore (`TENSORSTORE_GCS_HTTP_URL`), and every place a run reads or writes gs://:
datasets, rollout persistence and `inspect_rollouts`, checkpoint save + resume, HF export + `init_from_hf`, the fsspec
weight transport, metrics/summary/plot, and a whole SFT run (data in, outputs out) on gs://."""

import io
import json
import os
import socket
import uuid

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("gcp_storage_emulator")
gcsfs = pytest.importorskip("gcsfs")

BUCKET = "marin-rl-test"


def _patch_emulator_downloads() -> None:
    """The emulator's object downloads lack the `x-goog-generation` header that GCS sends and TensorStore reads
    (without it, reading an OCDBT checkpoint fails with 'Malformed StorageGeneration'); add it as GCS does."""
    from gcp_storage_emulator.handlers import objects

    if getattr(objects.download, "_with_generation", False):
        return
    original = objects.download

    def download(request, response, storage, *args, **kwargs):
        original(request, response, storage, *args, **kwargs)
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except Exception:  # not found: the original handler already answered 404
            return
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj["metageneration"])

    download._with_generation = True
    objects.download = download


@pytest.fixture(scope="module")
def gcs():
    """A GCS emulator on a free local port for this module; yields a function that returns a fresh gs:// prefix."""
    _patch_emulator_downloads()
    from gcp_storage_emulator.server import create_server  # after the patch: its routes bind the handlers on import

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")}
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = f"http://127.0.0.1:{port}"
    gcsfs.GCSFileSystem.clear_instance_cache()
    try:
        yield lambda: f"gs://{BUCKET}/{uuid.uuid4().hex[:8]}"
    finally:
        gcsfs.GCSFileSystem.clear_instance_cache()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def _exists(url: str) -> bool:
    fs, path = fsspec.core.url_to_fs(url)
    return fs.exists(path)


def test_datasets_read_from_gs(gcs):
    from marin_rl.envs.data import read_rows

    root = gcs()
    rows = [{"question": f"{a}+1", "answer": str(a + 1)} for a in range(5)]
    with fsspec.open(f"{root}/data/train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with fsspec.open(f"{root}/data/train.parquet", "wb") as f:
        pq.write_table(pa.Table.from_pylist(rows), f)
    for name in ("train.jsonl", "train.parquet"):
        found = read_rows(f"{root}/data/{name}")
        assert [r for _, r in found] == rows
        assert found[0][0].startswith(f"{root}/data/{name}")


def test_rollouts_persist_to_gs_and_inspect_reads_them(gcs):
    from test_replay_store import _group

    from marin_rl.programs.inspect_rollouts import summarize
    from marin_rl.replay.store import RolloutWriter, read_rollouts, rollout_to_row

    root = gcs()
    group = _group("e", np.random.default_rng(0))
    writer = RolloutWriter(f"{root}/rollouts/e", flush_rows=100)
    writer.append([rollout_to_row(r, group.group_id, 0.5, 10.0) for r in group.rollouts])
    assert writer.flush() is not None
    result = read_rollouts(f"{root}/rollouts")
    assert result.errors == [] and [s.rollout.to_dict() for s in result.rollouts] == [
        r.to_dict() for r in group.rollouts
    ]
    out = io.StringIO()
    assert summarize(f"{root}/rollouts", out=out) == 0
    assert f"{len(group.rollouts)} rollouts" in out.getvalue()


def test_checkpoints_save_and_resume_on_gs(gcs):
    from marin_rl.checkpoint_dirs import (
        MARKER_FILE,
        begin_checkpoint,
        is_complete,
        latest_checkpoint,
        prune_checkpoints,
        read_json,
        write_json,
    )
    from marin_rl.learner.checkpoint import load_learner_state, save_learner_state
    from marin_rl.learner.config import LearnerConfig
    from marin_rl.learner.learner import Learner
    from marin_rl.model.config import ModelConfig, tiny_llama
    from marin_rl.orchestrator.run_state import RUN_STATE_FILE

    root = f"{gcs()}/checkpoints"
    learner = Learner(ModelConfig(architecture=tiny_llama()), LearnerConfig(), 128)
    for step in (2, 4):
        path = begin_checkpoint(root, step)
        write_json(path, RUN_STATE_FILE, {"step": step})
        save_learner_state(learner, path, step)
    # a writer that died mid-save: its files are there but not the marker, which is written last
    dead = begin_checkpoint(root, 6)
    write_json(dead, RUN_STATE_FILE, {"step": 6})
    assert not is_complete(dead) and _exists(f"{root}/step-4/{MARKER_FILE}")
    assert latest_checkpoint(root) == f"{root}/step-4"
    assert prune_checkpoints(root, keep=1) == [dead, f"{root}/step-2"]
    assert not _exists(dead) and not _exists(f"{root}/step-2")

    other = Learner(ModelConfig(architecture=tiny_llama(), seed=1), LearnerConfig(), 128)
    load_learner_state(other, latest_checkpoint(root))
    assert read_json(latest_checkpoint(root), RUN_STATE_FILE) == {"step": 4}
    for a, b in zip(learner.weights(), other.weights(), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hf_export_and_init_from_hf_on_gs(gcs):
    import haliax as hax

    from marin_rl.model.build import build_model
    from marin_rl.model.config import ModelConfig, tiny_llama
    from marin_rl.model.hf import export_hf_checkpoint
    from marin_rl.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_model(ModelConfig(architecture=tiny_llama(), seed=3), len(tok))
    url = f"{gcs()}/hf/step-1"
    export_hf_checkpoint(model, tok, url)
    assert _exists(f"{url}/config.json") and _exists(f"{url}/model.safetensors")
    reloaded = build_model(ModelConfig(architecture=tiny_llama(), init_from_hf=url), len(tok))
    for a, b in zip(
        hax.state_dict.to_torch_compatible_state_dict(model).values(),
        hax.state_dict.to_torch_compatible_state_dict(reloaded).values(),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fsspec_weight_transport_on_gs(gcs):
    from marin_rl.broadcast.base import BroadcastConfig
    from marin_rl.broadcast.fsspec_checkpoint import FsspecTransport

    cfg = BroadcastConfig(transport="fsspec", path=f"{gcs()}/weights", chunk_mb=1, keep=2)
    learner, server = FsspecTransport(cfg), FsspecTransport(cfg)
    rng = np.random.default_rng(0)
    versions = {}
    for v in (1, 2, 3):
        versions[v] = [rng.normal(size=(600, 1000)).astype(np.float32), np.arange(5, dtype=np.int32)]
        learner.publish(v, versions[v])
    latest = server.latest()
    assert latest is not None and latest.version == 3
    for got, want in zip(server.fetch(latest), versions[3], strict=True):
        np.testing.assert_array_equal(got, want)


def test_metrics_summary_and_plot_on_gs(gcs):
    from marin_rl.report import plot_rewards, write_summary
    from marin_rl.tracking import JsonlTracker, read_metrics

    out = gcs()
    tracker = JsonlTracker(f"{out}/metrics.jsonl")
    for step in range(1, 4):
        tracker.log({"batches/e/reward/mean": 0.1 * step, "eval/e/reward": 0.2 * step}, step=step)
    tracker.finish()
    resumed = JsonlTracker(f"{out}/metrics.jsonl", resume_step=2, resume_path=f"{out}/checkpoints/step-2")
    resumed.log({"batches/e/reward/mean": 0.9}, step=3)
    resumed.finish()
    rows = read_metrics(f"{out}/metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["batches/e/reward/mean"] == 0.9
    write_summary(out, {"eval_reward_end": 0.6})
    with fsspec.open(f"{out}/summary.json") as f:
        assert json.load(f) == {"eval_reward_end": 0.6}
    plot_rewards(out, rows, ["e"])
    fs, path = fsspec.core.url_to_fs(f"{out}/reward.png")
    assert fs.size(path) > 10_000


@pytest.mark.gate_run  # a run whose data and outputs are on gs:// (seconds)
def test_sft_run_reads_and_writes_gs(gcs):
    from marin_rl.learner.config import LearnerConfig, SftConfig
    from marin_rl.learner.optimizer import OptimizerConfig
    from marin_rl.model.build import build_model
    from marin_rl.model.config import ModelConfig, tiny_llama
    from marin_rl.replay.batcher import BatcherConfig
    from marin_rl.run import RunConfig, run

    root = gcs()
    with fsspec.open(f"{root}/data/train.jsonl", "w") as f:
        f.writelines(json.dumps({"prompt": f"{a}+{a}=", "completion": str(2 * a)}) + "\n" for a in range(40))
    config = RunConfig(
        output_dir=f"{root}/sft",
        model=ModelConfig(architecture=tiny_llama()),
        batcher=BatcherConfig(max_seq_len=32),
        learner=LearnerConfig(
            mode="sft",
            sft=SftConfig(
                train_files=[f"{root}/data/train.jsonl"],
                steps=4,
                batch_rows=4,
                eval_every=2,
                log_every=2,
                optimizer=OptimizerConfig(learning_rate=3e-3),
            ),
        ),
    )
    summary = run(config)
    assert summary["eval_loss_end"] < summary["eval_loss_start"]
    for name in ("summary.json", "metrics.jsonl", "hf/step-4/config.json", "hf/step-4/model.safetensors"):
        assert _exists(f"{root}/sft/{name}"), name
    build_model(ModelConfig(architecture=tiny_llama(), init_from_hf=f"{root}/sft/hf/step-4"), 128)


@pytest.mark.slow
def test_quickstart_on_gs_finishes_and_resumes(gcs):
    """The quickstart, shortened, with `output_dir: gs://...`: Ray's actors (other processes) write there too."""
    from marin_rl.marin import apply_overrides
    from marin_rl.run import parse_config, run
    from marin_rl.tracking import read_metrics

    out = f"{gcs()}/quickstart"
    config = parse_config(["--config", "experiments/quickstart.yaml", "--output_dir", out])
    short = {
        "orchestrator.num_steps": 4,
        "orchestrator.eval_every": 4,
        "orchestrator.num_cpus": 2,
        "checkpoint.every": 2,
        "learner.warm_start.steps": 20,
        "envs.0.num_eval_problems": 20,
    }
    summary = run(apply_overrides(config, short))
    assert summary["steps"] == 4
    for name in ("summary.json", "metrics.jsonl", "reward.png", "hf/step-4/config.json", "checkpoints/step-4"):
        assert _exists(f"{out}/{name}"), name
    fs, path = fsspec.core.url_to_fs(f"{out}/rollouts/addition")
    assert fs.glob(f"{path}/*.parquet"), "accepted rollouts are persisted on gs://"

    resumed = run(apply_overrides(config, {**short, "orchestrator.num_steps": 6}))  # resumes from step 4
    assert resumed["steps"] == 6
    rows = read_metrics(f"{out}/metrics.jsonl")
    assert [r["step"] for r in rows if "learner/loss" in r] == [1, 2, 3, 4, 5, 6]
    with fsspec.open(f"{out}/metrics.jsonl") as f:
        assert any('"resume"' in line for line in f.read().decode().splitlines())
    assert _exists(f"{out}/checkpoints/step-6")
