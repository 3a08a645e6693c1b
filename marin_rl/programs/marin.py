"""marin_rl runs as steps of a Marin pipeline (`marin.execution`): supervised fine-tuning and RL under Marin's executor.

    from marin.execution import ExecutorMainConfig, executor_main, output_path_of, versioned
    from marin_rl.marin import run_step

    sft = run_step("sft_addition", "experiments/sft_addition.yaml",
                   {"learner.sft.steps": versioned(400), "learner.sft.train_files": [output_path_of(data, "x.jsonl")]})
    rl = run_step("rl_addition", "experiments/quickstart.yaml",
                  {"model.init_from_hf": output_path_of(sft, "hf/step-400"), "learner.warm_start.steps": 0})
    executor_main(ExecutorMainConfig(prefix="runs/marin"), steps=[sft, rl])

A step's config is a `RunStepConfig`: the experiment (a `RunConfig`, or the path of its YAML file), dotted-field
overrides, and the `output_path` the executor fills in (`this_output_path()`). The step function `run_experiment`
runs it with `output_dir` set to that path, so everything the run writes lands under the step's output: metrics,
summary, reward plot, rollouts, checkpoints and the Hugging Face export (`hf/step-N`) a later step reads with
`output_path_of(step, "hf/step-N")`. Its summary is also the step's artifact.

Overrides are where the executor's placeholders go: `output_path_of(...)` for inputs that other steps produce, and
`versioned(...)` around whatever changes the results (it enters the hash of the step's output path; the executor
resolves both before the step runs). They are applied to the parsed config with each dataclass's own checks, so a
wrong name or value fails the step with the field named.

Re-running a pipeline skips every step whose status is SUCCESS. A step that failed or was interrupted runs again in
the same output path, and the run resumes from its latest checkpoint there (`checkpoint.resume`, the default).

Only `run_step` needs Marin installed (`pip install -e ".[marin]"`); `RunStepConfig` and `run_experiment` do not.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from marin_rl.config import RunConfig, parse_config
from marin_rl.programs.run import run

logger = logging.getLogger("marin_rl")

__all__ = ["RunStepConfig", "apply_overrides", "run_experiment", "run_step"]


@dataclass(frozen=True)
class RunStepConfig:
    """The config of one marin_rl step: an experiment, overrides, and where its outputs go."""

    experiment: RunConfig | str
    """The experiment: a `RunConfig`, or the path of its YAML file (as `python -m marin_rl.run --config` takes it).
    Its `output_dir` is replaced by `output_path`."""
    output_path: str
    """The step's output directory; the executor fills it in (`this_output_path()`)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Dotted field name -> value, applied to the experiment in order: e.g. `{"model.init_from_hf":
    output_path_of(sft, "hf/step-400"), "orchestrator.num_steps": versioned(300)}`. List and dict values replace
    the field whole; a list element of `envs` is addressed as `envs.0.args`."""


def _set(obj: Any, path: list[str], value: Any, where: str) -> Any:
    """`obj` with the field at `path` replaced by `value` (dataclasses copied with `replace`, so that their checks
    run again; lists and dicts copied)."""
    name, rest = path[0], path[1:]
    if isinstance(obj, list):
        if not name.isdigit() or int(name) >= len(obj):
            raise ValueError(f"override {where!r}: {name!r} is not an index of a list of {len(obj)}")
        out = list(obj)
        out[int(name)] = _set(obj[int(name)], rest, value, where) if rest else value
        return out
    if isinstance(obj, dict):
        out = dict(obj)
        out[name] = _set(obj[name], rest, value, where) if rest else value
        return out
    if not dataclasses.is_dataclass(obj):
        raise ValueError(f"override {where!r}: {type(obj).__name__} has no field {name!r}")
    names = {f.name for f in dataclasses.fields(obj)}
    if name not in names:
        raise ValueError(f"override {where!r}: {type(obj).__name__} has no field {name!r} (fields: {sorted(names)})")
    new = _set(getattr(obj, name), rest, value, where) if rest else value
    return dataclasses.replace(obj, **{name: new})


def apply_overrides(config: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    """`config` with each dotted field of `overrides` set (in order); raises ValueError naming a field that does not
    exist or a value a config's own check rejects."""
    for key, value in overrides.items():
        try:
            config = _set(config, key.split("."), value, key)
        except (TypeError, ValueError) as e:
            if str(e).startswith("override "):
                raise
            raise ValueError(f"override {key!r}={value!r}: {e}") from e
    return config


def resolve(config: RunStepConfig) -> RunConfig:
    """The run a step config describes: the experiment, its overrides, and `output_dir` = the step's output path."""
    if not isinstance(config.output_path, str) or not config.output_path:
        raise ValueError(
            f"RunStepConfig.output_path must be a path (the executor fills in this_output_path()), "
            f"got {config.output_path!r}"
        )
    experiment = config.experiment
    if isinstance(experiment, str):
        try:
            experiment = parse_config(["--config", experiment])
        except SystemExit as e:  # the command line's way out; a step fails with an exception the executor records
            raise ValueError(str(e)) from None
    elif not isinstance(experiment, RunConfig):
        raise ValueError(f"RunStepConfig.experiment must be a RunConfig or a YAML path, got {type(experiment)}")
    experiment = apply_overrides(experiment, dict(config.overrides))
    experiment = dataclasses.replace(experiment, output_dir=config.output_path)
    return experiment.resolve()


def run_experiment(config: RunStepConfig) -> dict[str, Any]:
    """The step function: run the experiment (RL, or SFT when `learner.mode` is 'sft') with all its outputs under
    `config.output_path`, resuming from a checkpoint there if an earlier attempt left one; returns its summary."""
    experiment = resolve(config)
    summary = run(experiment)
    start, end = summary.get("eval_reward_start"), summary.get("eval_reward_end")
    if start is not None and end is not None:
        logger.info(
            "held-out reward %.3f -> %.3f (gain %+.3f); outputs in %s", start, end, end - start, experiment.output_dir
        )
    return summary


def run_step(name: str, experiment: RunConfig | str, overrides: dict[str, Any] | None = None, **kwargs):
    """An `ExecutorStep` named `name` that runs `experiment` with `overrides` (see `RunStepConfig`); other keyword
    arguments go to `ExecutorStep` (e.g. `description`). Needs Marin (`pip install -e ".[marin]"`)."""
    try:
        from marin.execution import ExecutorStep, this_output_path
    except ImportError as e:
        raise ImportError(f"marin_rl.marin.run_step needs Marin's executor: pip install -e '.[marin]' ({e})") from e
    if isinstance(experiment, str) and not os.path.exists(experiment) and "://" not in experiment:
        raise FileNotFoundError(f"experiment config {experiment!r} not found")
    return ExecutorStep(
        name=name,
        fn=run_experiment,
        config=RunStepConfig(experiment=experiment, output_path=this_output_path(), overrides=dict(overrides or {})),
        **kwargs,
    )
