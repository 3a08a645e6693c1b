"""Entry point: `python -m marin_rl.run --config experiments/NAME.yaml [--dotted.field value ...]`.

`run(config)` is also a plain function for pipelines that build the config in Python. It runs the RL loop, or
supervised fine-tuning when `learner.mode` is 'sft' (`marin_rl.learner.sft`: no Ray, servers or environments).
"""

from __future__ import annotations

import sys
from typing import Any

import draccus

from marin_rl.config import RunConfig
from marin_rl.learner.sft import run_sft
from marin_rl.orchestrator.orchestrator import run as run_rl

__all__ = ["RunConfig", "main", "run"]


def run(config: RunConfig) -> dict[str, Any]:
    """Run one experiment end to end and return its summary (also in `output_dir/summary.json`): the RL loop, or
    supervised fine-tuning when `learner.mode` is 'sft'."""
    if config.learner.mode == "sft":
        return run_sft(config)
    return run_rl(config)


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
    except draccus.utils.ParsingError as e:  # a config's own check (__post_init__) failed: its message names the field
        raise SystemExit(f"marin_rl: invalid configuration: {e.__cause__ or e}") from None
    try:
        config.validate()
    except ValueError as e:
        raise SystemExit(f"marin_rl: invalid configuration: {e}") from None
    return config


def main(args: list[str] | None = None) -> None:
    """Command-line entry point: parse the config and run; exits with 130 when interrupted."""
    config = parse_config(args)
    try:
        run(config)
    except KeyboardInterrupt:
        print(
            "marin_rl: interrupted; all actors were stopped (rerun the same command to resume from the latest "
            "checkpoint)",
            file=sys.stderr,
        )
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
