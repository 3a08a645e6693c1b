"""Train a reward model: `python -m marin_rl.reward_model`.

The program lives in `marin_rl.programs.reward_model`; this module keeps the command's name and re-exports its public
names."""

from marin_rl.programs.reward_model import main, parse_config, train_reward_model

__all__ = ["main", "parse_config", "train_reward_model"]

if __name__ == "__main__":
    main()
