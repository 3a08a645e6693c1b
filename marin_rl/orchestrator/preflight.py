"""What the driver checks before it starts anything (Ray, the learner, servers, env actors): the run directory's
remembered configuration against this one (`marin_rl.orchestrator.run_dir`), that environments which run tools in
sandboxes can make one here, and every environment's data, loaded once here. A failure is a `RunRefused`, whose
message the command line prints as it is, without a traceback:
`marin_rl: invalid data: train.jsonl:17: field 'question': expected a string, got int 42`.
"""

from __future__ import annotations

import logging
import time

from marin_rl.config import RunConfig, make_environment
from marin_rl.envs.base import load_environment_class
from marin_rl.envs.data import DataFormatError
from marin_rl.envs.sandbox import SandboxUnavailable, check_sandbox_available
from marin_rl.learner.config import check_platform
from marin_rl.orchestrator.run_dir import RunDirConflict, check_resume_config, remember_config

logger = logging.getLogger("marin_rl")


class RunRefused(ValueError):
    """The run cannot start as configured; the message says why and what to do (printed without a traceback)."""


def check_environment_data(config: RunConfig) -> dict[str, float]:
    """Build once, in this process, every environment whose class loads in the driver (`Environment.driver_check`:
    those whose construction only reads data), with the run's `batcher.max_seq_len`, so that a malformed row or a
    prompt that cannot fit stops the run here. Returns their `data_report`s as `data/<env>/<key>`, and logs them.
    Raises `RunRefused` ('invalid data: ...', or 'invalid configuration: envs[NAME]: ...' for arguments the class
    refuses)."""
    report: dict[str, float] = {}
    tokenizer = None
    for e in config.envs:
        try:
            if not load_environment_class(e.env_class).driver_check:
                continue
            if tokenizer is None:
                from marin_rl.tokenizer import load_tokenizer

                tokenizer = load_tokenizer(config.tokenizer)
            start = time.time()
            env = make_environment(e, tokenizer, seed=config.orchestrator.seed, max_seq_len=config.batcher.max_seq_len)
        except DataFormatError as err:
            raise RunRefused(f"invalid data: {err}") from None
        except ValueError as err:
            detail = str(err) if str(err).startswith(f"envs[{e.name}]") else f"envs[{e.name}]: {err}"
            raise RunRefused(f"invalid configuration: {detail}") from None
        counts = env.data_report()
        report.update({f"data/{e.name}/{key}": float(value) for key, value in counts.items()})
        logger.info(
            "data: %s: %s (checked in %.1fs)",
            e.name,
            ", ".join(f"{value} {key.replace('_', ' ')}" for key, value in counts.items()),
            time.time() - start,
        )
    return report


def check_sandboxes(config: RunConfig) -> None:
    """Refuse the run (`RunRefused`: 'missing tool: envs[NAME] runs tools in a sandbox: ...', naming the tool and
    how to install it) when an environment whose class `needs_sandbox` is configured and this machine cannot make
    a sandbox (`marin_rl.envs.sandbox.check_sandbox_available`)."""
    for e in config.envs:
        try:
            needs = load_environment_class(e.env_class).needs_sandbox
        except (ImportError, AttributeError, ValueError):
            continue  # a class that does not load is reported where the env is built
        if not needs:
            continue
        try:
            check_sandbox_available()
        except SandboxUnavailable as err:
            raise RunRefused(f"missing tool: envs[{e.name}] runs tools in a sandbox: {err}") from None


def preflight(config: RunConfig, resume_path: str | None) -> dict[str, float]:
    """Everything checked before the run starts, in order of cost: the learner's platform (`learner.platform`, on the
    local backend, whose driver is the learner), the remembered configuration when resuming from `resume_path`, the
    sandbox when an environment needs one (`check_sandboxes`), then the environments' data; then `config` is
    remembered in `output_dir`. Returns the data report (`check_environment_data`); raises `RunRefused`."""
    if config.orchestrator.backend == "local":  # this process is the learner's: its devices are the learner's
        try:
            check_platform(config.learner.platform)
        except ValueError as err:
            raise RunRefused(f"invalid configuration: {err}") from None
    try:
        check_resume_config(config, resume_path)
    except RunDirConflict as err:
        raise RunRefused(str(err)) from None
    check_sandboxes(config)
    report = check_environment_data(config)
    remember_config(config)
    return report
