"""An experiment as a Marin pipeline step: `from marin_rl.marin import run_step`.

The program lives in `marin_rl.programs.marin`; this module keeps the command's name and re-exports its public
names."""

from marin_rl.programs.marin import RunStepConfig, apply_overrides, run_experiment, run_step

__all__ = ["RunStepConfig", "apply_overrides", "run_experiment", "run_step"]
