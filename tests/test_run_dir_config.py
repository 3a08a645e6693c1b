"""A run directory remembers its configuration: a resume under a config that differs in a field that changes results
is refused before anything starts, listing the fields (old → new) and the two ways on; harmless differences are
accepted; `checkpoint.resume: force` resumes anyway."""

import logging
import time
from pathlib import Path

import pytest
import yaml

from marin_rl.checkpoint_dirs import latest_checkpoint
from marin_rl.config import CheckpointConfig, parse_config
from marin_rl.frozen import thaw
from marin_rl.orchestrator.run_dir import (
    CONFIG_FILE,
    RunDirConflict,
    check_resume_config,
    config_dict,
    differences,
    harmless,
    remember_config,
    remembered_config,
)

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "experiments" / "quickstart.yaml")


def quickstart(out: Path, *overrides: str):
    return thaw(parse_config(["--config", QUICKSTART, "--output_dir", str(out), *overrides]))  # tests change it


def fake_checkpoint(out: Path, step: int = 50) -> str:
    """A complete checkpoint directory as `latest_checkpoint` finds one (its completion marker): what a finished run
    leaves for the next command to resume."""
    path = out / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True)
    (path / "metadata.json").write_text(f'{{"step": {step}, "timestamp": "2026-01-01T00:00:00"}}')
    assert latest_checkpoint(str(out / "checkpoints")) == str(path)
    return str(path)


def test_the_config_is_written_and_read_back_unchanged(tmp_path):
    config = quickstart(
        tmp_path,
        "--inference.control_secret",
        "s3cret",
        "--inference.api_key",
        "k3y-s3cret",
        "--broadcast.secret",
        "fl1ght-s3cret",
    )
    path = remember_config(config)
    assert path == str(tmp_path / CONFIG_FILE)
    for secret in ("s3cret", "k3y-s3cret", "fl1ght-s3cret"):  # no secret setting is written
        assert secret not in Path(path).read_text()
    saved = remembered_config(config)
    assert saved["learner"]["optimizer"]["learning_rate"] == config.learner.optimizer.learning_rate
    assert differences(saved, config_dict(config)) == []
    assert yaml.safe_load(Path(path).read_text())["envs"][0]["name"] == "addition"


def test_a_changed_config_is_refused_listing_the_fields_old_and_new(tmp_path):
    """The README's sequence: the override example writes runs/quickstart, then the quickstart command resumes it."""
    first = quickstart(tmp_path, "--orchestrator.num_steps", "50", "--learner.optimizer.learning_rate", "1e-4")
    remember_config(first)
    ckpt = fake_checkpoint(tmp_path)
    second = quickstart(tmp_path, "--batcher.max_seq_len", "48")
    second.envs[0].args = {**second.envs[0].args, "max_operand": 9}
    with pytest.raises(RunDirConflict) as err:
        check_resume_config(second, ckpt)
    message = str(err.value)
    lines = message.splitlines()
    assert lines[0] == (
        f"output_dir {tmp_path} holds a run (checkpoint {ckpt}) whose configuration ({tmp_path / CONFIG_FILE}) "
        "differs from this one in:"
    )
    assert lines[1:4] == [
        "  envs[addition].args.max_operand: 49 → 9",
        "  batcher.max_seq_len: 64 → 48",
        f"  learner.optimizer.learning_rate: 0.0001 → {second.learner.optimizer.learning_rate}",
    ]
    assert "orchestrator.num_steps" not in message  # 50 → 100 extends the run
    assert "--output_dir" in lines[-1] and "--checkpoint.resume force" in lines[-1]
    # a fresh start (no checkpoint to resume) is not compared
    check_resume_config(second, None)


def test_harmless_differences_are_accepted(tmp_path):
    first = quickstart(tmp_path, "--orchestrator.num_steps", "50")
    remember_config(first)
    ckpt = fake_checkpoint(tmp_path)
    changed = [
        "--orchestrator.num_steps",
        "200",
        "--orchestrator.eval_every",
        "7",
        "--tracking.console_every",
        "10",
        "--tracking.wandb_mode",
        "offline",
        "--checkpoint.every",
        "5",
        "--checkpoint.keep",
        "4",
        "--orchestrator.compilation_cache_dir",
        str(tmp_path / "cache"),
        "--orchestrator.num_cpus",
        "3",
        "--placement.wait_timeout_s",
        "99",
        "--model.export_every",
        "9",
    ]
    second = quickstart(tmp_path, *changed)
    assert differences(remembered_config(first), config_dict(second)) == []
    check_resume_config(second, ckpt)
    for field in ("tracking.run_name", "placement.learner.num_gpus", "orchestrator.ray_address", "checkpoint.resume"):
        assert harmless(field), field
    for field in ("learner.optimizer.learning_rate", "orchestrator.seed", "envs[a].group_size", "placementx"):
        assert not harmless(field), field


def test_force_resumes_anyway_and_logs_the_differences(tmp_path, caplog):
    remember_config(quickstart(tmp_path))
    ckpt = fake_checkpoint(tmp_path)
    forced = quickstart(tmp_path, "--learner.optimizer.learning_rate", "1e-4", "--checkpoint.resume", "force")
    assert forced.checkpoint.resume == "force"
    with caplog.at_level(logging.WARNING, logger="marin_rl"):
        check_resume_config(forced, ckpt)
    [record] = [r.getMessage() for r in caplog.records if "checkpoint.resume: force" in r.getMessage()]
    assert record.endswith("learning_rate: 0.0003 → 0.0001")
    with pytest.raises(ValueError, match="checkpoint.resume must be true, false or 'force'"):
        CheckpointConfig(resume="always")


@pytest.mark.exclusive  # the refusal's wall-clock bound
def test_a_changed_config_stops_the_command_before_ray_starts(tmp_path):
    """The whole command line (`parse_config`, then `run`) on a run directory with a checkpoint and another config:
    refused, without a traceback, before Ray or any process starts; the remembered config is left as it was."""
    import ray

    from marin_rl.run import main

    out = tmp_path / "quickstart"
    remember_config(quickstart(out, "--orchestrator.num_steps", "50", "--learner.optimizer.learning_rate", "1e-4"))
    before = (out / CONFIG_FILE).read_text()
    fake_checkpoint(out)
    start = time.time()
    with pytest.raises(SystemExit) as exit_:
        main(["--config", QUICKSTART, "--output_dir", str(out)])
    elapsed = time.time() - start
    message = str(exit_.value.code)
    assert message.startswith(f"marin_rl: output_dir {out} holds a run"), message
    assert "  learner.optimizer.learning_rate: 0.0001 → 0.0003" in message.splitlines()
    assert elapsed < 15, elapsed
    assert not ray.is_initialized()
    assert (out / CONFIG_FILE).read_text() == before
