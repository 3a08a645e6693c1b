"""The entry-point programs, one module per command. They sit at the top of the layers: they may import anything
below them, and nothing in the library imports them.

- `run` — an experiment end to end: `python -m marin_rl.run --config experiments/NAME.yaml [--dotted.field value]`,
  or `run(config)` from Python; supervised fine-tuning (`sft`) when `learner.mode` is 'sft'.
- `try_env` — a few episodes of one environment: `python -m marin_rl.try_env ENV_NAME --config experiments/NAME.yaml`.
- `inspect_rollouts` — a summary of stored rollouts: `python -m marin_rl.inspect_rollouts PATH`.
- `graph` — a run's algorithm drawn and listed: `python -m marin_rl.graph --config experiments/NAME.yaml`.
- `reward_model` — a reward model trained: `python -m marin_rl.reward_model --config experiments/NAME.yaml`.
- `marin` — an experiment as a step of a Marin pipeline: `from marin_rl.marin import run_step`.

The commands keep their short names: `marin_rl/run.py`, `marin_rl/try_env.py`, ... are small shims that re-export a
program's public names and run its `main`. The GGUF converter (`python -m marin_rl.gguf FILE.gguf OUT_DIR`) stays
with its library in `marin_rl/gguf.py`.
"""
