"""Try one environment: `python -m marin_rl.try_env`.

The program lives in `marin_rl.programs.try_env`; this module keeps the command's name and re-exports its public
names."""

from marin_rl.programs.try_env import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
