"""Summarise stored rollouts: `python -m marin_rl.inspect_rollouts`.

The program lives in `marin_rl.programs.inspect_rollouts`; this module keeps the command's name and re-exports its
public names."""

from marin_rl.programs.inspect_rollouts import main, summarize

__all__ = ["main", "summarize"]

if __name__ == "__main__":
    raise SystemExit(main())
