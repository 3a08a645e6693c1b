"""Run a few episodes of one environment and print the conversations and rewards.

    python -m marin_rl.try_env ENV_NAME --config experiments/NAME.yaml [--checkpoint PATH] [--server HOST:PORT]

Without `--server` a policy is served by an embedded Levanter server started in this process: `--checkpoint PATH`'s
(a Hugging Face export directory such as `runs/quickstart/hf/step-300`, a learner checkpoint directory, or a run's
output directory, whose newest export or checkpoint is used), else the config's `model` (`model.init_from_hf`, or
random weights, which the program says: their answers are garbage and earn no reward). For environment authors
checking prompts, parsing and rewards, and for looking at what a trained policy answers.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import re
import sys

import equinox as eqx
import jax
import numpy as np
from rich.console import Console
from rich.text import Text

from marin_rl.checkpoint_dirs import checkpoint_step, is_complete, latest_checkpoint
from marin_rl.config import RunConfig, make_environment, parse_config
from marin_rl.envs.data import DataFormatError
from marin_rl.logs import configure_logging
from marin_rl.rollouts.worker import RolloutWorker
from marin_rl.tokenizer import load_tokenizer
from marin_rl.types import RolloutGroup

RANDOM_WEIGHTS_LINE = (
    "sampling from RANDOM weights (no --checkpoint, no model.init_from_hf): expect garbage answers and reward 0; "
    "pass --checkpoint runs/NAME (a run directory or one of its hf/step-N exports) to try a trained policy"
)
"""Printed (to stderr) when the embedded server samples from a randomly initialised policy."""

_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclasses.dataclass(frozen=True)
class PolicyCheckpoint:
    """A policy to load: a Hugging Face export (`kind` "hf") or a learner checkpoint (`kind` "learner")."""

    kind: str
    path: str
    step: int | None = None
    """The learner step it holds, when known."""


def _newest_export(hf_root: str) -> PolicyCheckpoint | None:
    """The highest `step-N` under `hf_root` that holds a config.json (an HF export of a run), or None."""
    if not os.path.isdir(hf_root):
        return None
    found = []
    for name in os.listdir(hf_root):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(hf_root, name, "config.json")):
            found.append((int(m.group(1)), os.path.join(hf_root, name)))
    if not found:
        return None
    step, path = max(found)
    return PolicyCheckpoint("hf", path, step)


def find_policy_checkpoint(path: str) -> PolicyCheckpoint:
    """What `--checkpoint PATH` names: an HF export directory (it has config.json), a complete learner checkpoint
    (it has the completion marker), or a run's output directory, whose newest HF export (`hf/step-N`) or newest
    complete checkpoint (`checkpoints/step-N`) is taken, the export when both are at the same step. Raises
    FileNotFoundError naming what was looked for."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return PolicyCheckpoint("hf", path)
    if is_complete(path):
        return PolicyCheckpoint("learner", path, checkpoint_step(path))
    export = _newest_export(os.path.join(path, "hf"))
    latest = latest_checkpoint(os.path.join(path, "checkpoints"))
    saved = PolicyCheckpoint("learner", latest, checkpoint_step(latest)) if latest is not None else None
    if export is not None and (saved is None or export.step >= saved.step):
        return export
    if saved is not None:
        return saved
    raise FileNotFoundError(
        f"--checkpoint {path}: no Hugging Face export (config.json), complete checkpoint, hf/step-N export or "
        "checkpoints/step-N checkpoint there"
    )


def load_policy(config: RunConfig, found: PolicyCheckpoint, vocab_size: int):
    """The policy held by `found`, for the run config's model architecture."""
    from marin_rl.model.build import build_model

    if found.kind == "hf":
        return build_model(dataclasses.replace(config.model, init_from_hf=found.path), vocab_size)
    from marin_rl.learner.checkpoint import load_learner_state
    from marin_rl.learner.learner import Learner

    learner = Learner(config.model, config.learner, vocab_size)
    load_learner_state(learner, found.path)
    return learner.model


def _print_group(console: Console, tokenizer, group: RolloutGroup) -> None:
    console.rule(f"[bold]{group.environment}[/] problem {group.problem_id}")
    for k, rollout in enumerate(group.rollouts):
        console.print(f"[dim]episode {k}  reward {rollout.reward:.3f}  truncated {rollout.truncated}[/]")
        for turn in rollout.turns:
            style = "green" if turn.is_sampled else "cyan"
            text = Text(f"  [{turn.role}{'*' if turn.is_sampled else ''}] ", style=f"bold {style}")
            text.append(repr(tokenizer.decode(turn.token_ids)), style=style)
            if turn.rewards:
                text.append(f"  rewards={turn.rewards}", style="yellow")
            if turn.inference_metadata is not None:
                m = turn.inference_metadata
                text.append(f"  ({len(turn.token_ids)} tokens, {m.finish_reason}, v{m.version_start})", style="dim")
            console.print(text)


async def _run(config: RunConfig, env_name: str, server: str, problems: int, group_size: int, held_out: bool):
    env_config = next(e for e in config.envs if e.name == env_name)
    tokenizer = load_tokenizer(config.tokenizer)
    env = make_environment(env_config, tokenizer, seed=config.orchestrator.seed, max_seq_len=config.batcher.max_seq_len)
    chosen = (env.eval_problems() if held_out else env.train_problems())[:problems]
    worker = RolloutWorker([server], timeout_s=config.inference.request_timeout_s, api_key=config.inference.api_key)
    try:
        groups = await worker.run_groups(env, chosen, group_size, env_config.sampling)
    finally:
        await worker.aclose()
    console = Console()
    for g in groups:
        _print_group(console, tokenizer, g)
    rewards = [r.reward for g in groups for r in g.rollouts]
    console.rule()
    console.print(f"{len(rewards)} episodes on {len(groups)} problems: mean reward {sum(rewards) / len(rewards):.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m marin_rl.try_env", description=__doc__.split("\n\n")[0])
    parser.add_argument("env", help="name of an environment in the config's `envs`")
    parser.add_argument("--config", required=True, help="experiment YAML")
    parser.add_argument("--server", help="HOST:PORT of a running OpenAI-compatible server (default: embedded)")
    parser.add_argument(
        "--checkpoint",
        help="policy for the embedded server: an HF export directory, a learner checkpoint, or a run directory (its "
        "newest hf/step-N export or checkpoint); default: the config's model",
    )
    parser.add_argument("--problems", type=int, default=3, help="problems to run (default 3)")
    parser.add_argument("--group-size", type=int, default=None, help="episodes per problem (default: the env's)")
    parser.add_argument("--held-out", action="store_true", help="use held-out problems instead of training ones")
    args = parser.parse_args(argv)
    config = parse_config(["--config", args.config])
    names = [e.name for e in config.envs]
    if args.env not in names:
        raise SystemExit(f"unknown environment {args.env!r}; the config has {names}")
    configure_logging()
    env_config = next(e for e in config.envs if e.name == args.env)
    group_size = args.group_size or env_config.group_size
    embedded = None
    server = args.server
    if server is not None and args.checkpoint:
        raise SystemExit("--checkpoint loads a policy into the embedded server; it cannot be used with --server")
    if server is None:
        from marin_rl.inference.levanter_server import LevanterInferenceServer
        from marin_rl.model.build import build_model
        from marin_rl.model.precision import compute_dtype_here

        tokenizer = load_tokenizer(config.tokenizer)
        if args.checkpoint:
            try:
                found = find_policy_checkpoint(args.checkpoint)
            except FileNotFoundError as e:
                raise SystemExit(str(e)) from None
            step = f" (step {found.step})" if found.step is not None else ""
            what = "Hugging Face export" if found.kind == "hf" else "learner checkpoint"
            print(f"policy: the {what} at {found.path}{step}", file=sys.stderr)
            model = load_policy(config, found, len(tokenizer))
        else:
            if config.model.init_from_hf is None:
                print(RANDOM_WEIGHTS_LINE, file=sys.stderr)
            else:
                print(f"policy: model.init_from_hf = {config.model.init_from_hf}", file=sys.stderr)
            model = build_model(config.model, len(tokenizer))
        print("starting an embedded server (the first request compiles)...", file=sys.stderr)
        dtype = compute_dtype_here(config.model.compute_dtype)  # the run's engine samples in it too
        embedded = LevanterInferenceServer(model, tokenizer, config.inference, compute_dtype=dtype)
        embedded.apply_weights(0, [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))])
        server = embedded.start()
    try:
        asyncio.run(_run(config, args.env, server, args.problems, group_size, args.held_out))
    except DataFormatError as e:  # a malformed row or a prompt too long: one line, as `marin_rl.run` says it
        raise SystemExit(f"marin_rl: invalid data: {e}") from None
    finally:
        if embedded is not None:
            embedded.stop()


if __name__ == "__main__":
    main()
