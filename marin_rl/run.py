"""Entry point: `python -m marin_rl.run --config experiments/NAME.yaml [--dotted.field value ...]`.

`run(config)` is also a plain function for pipelines that build the config in Python. It runs the RL loop, or
supervised fine-tuning when `learner.mode` is 'sft' (`marin_rl.sft`: no Ray, servers or environments).
"""

from __future__ import annotations

import sys
from typing import Any

from marin_rl.config import RunConfig, parse_config
from marin_rl.orchestrator.orchestrator import run as run_rl
from marin_rl.orchestrator.preflight import RunRefused
from marin_rl.sft import run_sft

__all__ = ["RunConfig", "main", "parse_config", "run"]


def run(config: RunConfig) -> dict[str, Any]:
    """Run one experiment end to end and return its summary (also in `output_dir/summary.json`): the RL loop, or
    supervised fine-tuning when `learner.mode` is 'sft'."""
    if config.learner.mode == "sft":
        return run_sft(config)
    return run_rl(config)


def main(args: list[str] | None = None) -> None:
    """Command-line entry point: parse the config and run; exits with 130 when interrupted, and with the reason (no
    traceback) when the run is refused before it starts (bad data, a run directory holding another config's run)."""
    config = parse_config(args)
    try:
        run(config)
    except RunRefused as e:
        raise SystemExit(f"marin_rl: {e}") from None
    except KeyboardInterrupt:
        print(
            "marin_rl: interrupted; all actors were stopped (rerun the same command to resume from the latest "
            "checkpoint)",
            file=sys.stderr,
        )
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
