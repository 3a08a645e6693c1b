"""Entry point: `python -m marin_rl.run --config experiments/NAME.yaml [--dotted.field value ...]`.

`run(config)` is also a plain function for pipelines that build the config in Python.
"""

from __future__ import annotations

import sys

import draccus

from marin_rl.config import RunConfig
from marin_rl.orchestrator.orchestrator import run

__all__ = ["RunConfig", "main", "run"]


def parse_config(args: list[str] | None = None) -> RunConfig:
    """Parse `--config FILE` plus dotted overrides; exits with a message naming the bad key or value."""
    args = list(sys.argv[1:] if args is None else args)
    config_path = None
    for i, a in enumerate(args):
        if a in ("--config", "--config_path") and i + 1 < len(args):
            config_path = args[i + 1]
            del args[i : i + 2]
            break
        if a.startswith(("--config=", "--config_path=")):
            config_path = a.split("=", 1)[1]
            del args[i]
            break
    try:
        config = draccus.parse(RunConfig, config_path=config_path, args=args)
    except (draccus.utils.DecodingError, FileNotFoundError) as e:
        raise SystemExit(f"marin_rl: invalid configuration: {e}") from None
    try:
        config.validate()
    except ValueError as e:
        raise SystemExit(f"marin_rl: invalid configuration: {e}") from None
    return config


def main(args: list[str] | None = None) -> None:
    config = parse_config(args)
    try:
        run(config)
    except KeyboardInterrupt:
        print("marin_rl: interrupted; all actors were stopped", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
