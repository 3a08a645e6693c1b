"""Draw and list a run's algorithm: `python -m marin_rl.graph`.

The program lives in `marin_rl.programs.graph`; this module keeps the command's name and re-exports its public
names."""

from marin_rl.programs.graph import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
