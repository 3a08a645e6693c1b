"""Run a few episodes of one environment and print the conversations and rewards.

    python -m marin_rl.try_env ENV_NAME --config experiments/NAME.yaml [--server HOST:PORT] [--problems 3]

Without `--server` the policy of the config (`model`: random init, or `model.init_from_hf`) is served by an
embedded Levanter server started in this process. For environment authors checking prompts, parsing and rewards.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import equinox as eqx
import jax
import numpy as np
from rich.console import Console
from rich.text import Text

from marin_rl.api.rollouts import RolloutWorker
from marin_rl.config import RunConfig, make_environment, parse_config
from marin_rl.envs.data import DataFormatError
from marin_rl.logs import configure_logging
from marin_rl.tokenizer import load_tokenizer
from marin_rl.types import RolloutGroup


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
    if server is None:
        from marin_rl.inference.levanter_server import LevanterInferenceServer
        from marin_rl.model.build import build_model

        tokenizer = load_tokenizer(config.tokenizer)
        print("starting an embedded server with the config's model (first request compiles)...", file=sys.stderr)
        model = build_model(config.model, len(tokenizer))
        embedded = LevanterInferenceServer(model, tokenizer, config.inference)
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
