"""The entry-point programs: each module here is what one command runs. They sit at the top of the layers (they may
import anything below them, and nothing in the library imports them).

    python -m marin_rl.run --config experiments/NAME.yaml [--dotted.field value ...]   run      an experiment end to end
                                                                        (RL; supervised fine-tuning when
                                                                        `learner.mode: sft`, in `sft`)
    python -m marin_rl.try_env ENV_NAME --config experiments/NAME.yaml  try_env  a few episodes of one environment
    python -m marin_rl.inspect_rollouts PATH                            inspect_rollouts  summarise stored rollouts
    python -m marin_rl.graph --config experiments/NAME.yaml             graph    draw and list a run's algorithm
    python -m marin_rl.reward_model --config experiments/NAME.yaml      reward_model  train a reward model
    from marin_rl.marin import run_step                                 marin    an experiment as a Marin pipeline step

The commands keep their short names: `marin_rl/run.py`, `marin_rl/try_env.py`, ... are small shims that re-export
a program's public names and run its `main`. (`python -m marin_rl.gguf FILE.gguf OUT_DIR`, the GGUF converter, stays
with its library in `marin_rl/gguf.py`.)
"""
