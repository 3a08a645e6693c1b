"""marin_rl as steps of a Marin pipeline: `experiments/marin_pipeline.py` (data -> SFT -> RL, tiny sizes) under
Marin's real executor; step outputs, status files, skipping finished steps and resuming an interrupted one."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from marin_rl.config import RunConfig
from marin_rl.programs.marin import RunStepConfig, apply_overrides, resolve

ROOT = Path(__file__).resolve().parents[1]


def test_overrides_set_nested_fields_and_name_bad_ones():
    config = apply_overrides(
        RunConfig(),
        {"orchestrator.num_steps": 7, "envs.0.args": {"max_operand": 9}, "model.init_from_hf": "gs://b/hf/step-4"},
    )
    assert config.orchestrator.num_steps == 7 and config.envs[0].args == {"max_operand": 9}
    assert config.model.init_from_hf == "gs://b/hf/step-4"
    with pytest.raises(ValueError, match="orchestrator.num_stepz"):
        apply_overrides(RunConfig(), {"orchestrator.num_stepz": 7})
    with pytest.raises(ValueError, match="checkpoint.every"):  # the dataclass's own check runs again
        apply_overrides(RunConfig(), {"checkpoint.every": -1})
    with pytest.raises(ValueError, match="envs.3"):
        apply_overrides(RunConfig(), {"envs.3.name": "x"})


def test_a_step_writes_under_its_output_path():
    step = RunStepConfig(
        experiment=str(ROOT / "experiments" / "quickstart.yaml"),
        output_path="gs://bucket/rl-abc123",
        overrides={"orchestrator.num_steps": 5},
    )
    config = resolve(step)
    assert config.output_dir == "gs://bucket/rl-abc123" and config.checkpoint_dir == "gs://bucket/rl-abc123/checkpoints"
    assert config.orchestrator.num_steps == 5
    with pytest.raises(ValueError, match="output_path"):
        resolve(RunStepConfig(experiment=RunConfig(), output_path=""))
    with pytest.raises(ValueError, match="invalid configuration"):
        resolve(RunStepConfig(experiment=str(ROOT / "no-such.yaml"), output_path="x"))


def _pipeline_module():
    spec = importlib.util.spec_from_file_location("marin_pipeline", ROOT / "experiments" / "marin_pipeline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _status(step_dir: Path) -> str:
    return (step_dir / ".executor_status").read_text().strip()


@pytest.mark.slow
def test_pipeline_runs_under_marins_executor_skips_finished_steps_and_resumes(tmp_path, monkeypatch):
    execution = pytest.importorskip("marin.execution")
    import marin_rl.programs.marin

    pipeline = _pipeline_module()
    prefix = tmp_path / "marin"
    sft_steps, rl_steps = 40, 6

    def run_pipeline():
        steps = pipeline.build_steps(sft_steps, rl_steps, eval_every=rl_steps, num_cpus=2, smoke=True)
        execution.executor_main(execution.ExecutorMainConfig(prefix=str(prefix)), steps=steps)

    run_pipeline()
    [data] = prefix.glob("addition_sft_data-*")
    [sft] = prefix.glob("sft_addition-*")
    [rl] = prefix.glob("rl_addition-*")
    assert [_status(d) for d in (data, sft, rl)] == ["SUCCESS"] * 3

    assert len((data / "addition_sft.jsonl").read_text().splitlines()) == 50 * 50 - 200
    assert (sft / "hf" / f"step-{sft_steps}" / "config.json").exists()
    sft_summary = json.loads((sft / "summary.json").read_text())
    assert sft_summary["eval_loss_end"] < sft_summary["eval_loss_start"], sft_summary

    summary = json.loads((rl / "summary.json").read_text())
    assert summary["steps"] == rl_steps
    assert json.loads((rl / ".artifact.json").read_text())["steps"] == rl_steps  # the step's artifact is its summary
    assert (rl / "hf" / f"step-{rl_steps}" / "config.json").exists()
    assert (rl / "metrics.jsonl").exists() and (rl / "reward.png").exists()
    assert sorted(p.name for p in (rl / "checkpoints").glob("step-*")) == ["step-4", f"step-{rl_steps}"]
    print(f"held-out reward {summary['eval_reward_start']:.3f} -> {summary['eval_reward_end']:.3f}")

    # Run again: every step succeeded, so none runs.
    def must_not_run(config):
        raise AssertionError(f"a finished step ran again: {config.output_dir}")

    with monkeypatch.context() as m:
        m.setattr(marin_rl.programs.marin, "run", must_not_run)
        run_pipeline()
    assert [_status(d) for d in (data, sft, rl)] == ["SUCCESS"] * 3

    # An RL step killed after its checkpoint at step 4: RUNNING, no live lock, no later checkpoint. The next run
    # takes it over and resumes from step 4 in the same directory.
    import shutil

    shutil.rmtree(rl / "checkpoints" / f"step-{rl_steps}")
    os.remove(rl / "summary.json")
    (rl / ".executor_status").write_text("RUNNING")
    for lock in rl.glob(".executor_status.lock*"):
        lock.unlink()
    run_pipeline()
    assert _status(rl) == "SUCCESS"
    resumed = json.loads((rl / "summary.json").read_text())
    assert resumed["steps"] == rl_steps
    rows = [json.loads(line) for line in (rl / "metrics.jsonl").read_text().splitlines()]
    trained = [r["step"] for r in rows if "learner/loss" in r]
    assert trained == list(range(1, rl_steps + 1)) + list(range(5, rl_steps + 1)), trained
