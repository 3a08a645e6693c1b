"""Run an experiment end to end: `python -m marin_rl.run`.

The program lives in `marin_rl.programs.run`; this module keeps the command's name and re-exports its public
names."""

from marin_rl.programs.run import RunConfig, main, parse_config, run

__all__ = ["RunConfig", "main", "parse_config", "run"]

if __name__ == "__main__":
    main()
