"""Entry point: `python -m marin_rl.run --config experiments/NAME.yaml [--dotted.field value ...]`.

`run(config)` is also a plain function for pipelines that build the config in Python. It runs the RL loop, or
supervised fine-tuning when `learner.mode` is 'sft' (`marin_rl.programs.sft`: no Ray, servers or environments).
"""

from __future__ import annotations

import sys
from typing import Any

from marin_rl.cli_help import PLACEHOLDER, placeholder_fields
from marin_rl.config import RunConfig, parse_config
from marin_rl.orchestrator.orchestrator import run as run_rl
from marin_rl.orchestrator.preflight import RunRefused
from marin_rl.orchestrator.teacher_recipe import ensure_teacher
from marin_rl.placement import PlacementError
from marin_rl.programs.sft import run_sft

__all__ = ["RunConfig", "main", "parse_config", "run"]


def run(config: RunConfig) -> dict[str, Any]:
    """Run one experiment end to end and return its summary (also in `output_dir/summary.json`): the RL loop, or
    supervised fine-tuning when `learner.mode` is 'sft'. A distillation run whose teacher does not exist yet makes it
    first (`teacher.recipe`)."""
    if config.learner.mode == "sft":
        return run_sft(config)
    config = config.resolve()  # a bad config is refused before minutes of making its teacher
    if config.teacher is not None:
        ensure_teacher(config)
    return run_rl(config)


def refuse_placeholders(config: RunConfig) -> None:
    """Exit with one line naming a field that still holds an example config's placeholder (`gs://YOUR_BUCKET/...`),
    before anything starts (such a path would otherwise be retried for a minute and fail deep in the run)."""
    found = placeholder_fields(config)
    if found:
        key, value, settable = found[0]
        where = f"in the config file or with --{key} VALUE" if settable else "in the config file"
        raise SystemExit(
            f"marin_rl: invalid configuration: {key}: {value!r} holds the placeholder "
            f"{PLACEHOLDER.search(value).group(0)}; replace it {where}"
        )


def main(args: list[str] | None = None) -> None:
    """Command-line entry point: parse the config and run; exits with 130 when interrupted, and with one line (no
    traceback) when the run is refused before it starts (bad data, a run directory holding another config's run) or
    the cluster cannot hold it (`PlacementError`)."""
    config = parse_config(args)
    refuse_placeholders(config)
    try:
        run(config)
    except (RunRefused, PlacementError) as e:
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
