"""Sampler-learner agreement: how far the engine's per-token logprobs are from the learner's on the same tokens.

RL's importance ratios (π_learner / π_sampler) assume the two compute the same distribution; any gap between them is
bias the loss's corrections must absorb. This samples groups from a config's environment with the engine the run
would use (the embedded Levanter engine in `inference.levanter`'s mode, serving the learner's own initial policy:
`model.init_from_hf` or its seeded initialisation) at the config's sampling settings, packs them as the batcher does,
recomputes every sampled token's logprob with the learner, and prints mean and max |Δ logprob| over the batch, with
the seconds each side took.

    python benchmarks/sampler_agreement.py --config experiments/smollm2_math.yaml [--problems 8] [--group-size 8]

`--smoke` runs the quickstart's tiny model (experiments/quickstart_local.yaml) on a few problems, in seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(config_path: str, env_name: str | None, problems: int, group_size: int | None) -> dict[str, float]:
    """Sample `problems` x `group_size` episodes with the config's engine and compare their logprobs."""
    from marin_rl.config import make_environment, parse_config
    from marin_rl.envs.base import run_groups
    from marin_rl.inference.levanter_server import LevanterInferenceServer
    from marin_rl.learner.learner import Learner
    from marin_rl.replay.packing import Sequence, pack
    from marin_rl.tokenizer import load_tokenizer

    config = parse_config(["--config", config_path])
    config.configure_jax()
    env_config = next((e for e in config.envs if env_name in (None, e.name)), None)
    if env_config is None:
        raise SystemExit(f"unknown environment {env_name!r}; the config has {[e.name for e in config.envs]}")
    tokenizer = load_tokenizer(config.tokenizer)
    env = make_environment(env_config, tokenizer, seed=config.orchestrator.seed, max_seq_len=config.batcher.max_seq_len)
    t = time.perf_counter()
    learner = Learner(config.model, config.learner, len(tokenizer), temperature=env_config.sampling.temperature)
    build_s = time.perf_counter() - t
    server = LevanterInferenceServer(learner.model, tokenizer, config.inference)
    server.apply_weights(0, learner.weights())
    address = server.start()
    try:
        n = group_size or env_config.group_size
        chosen = env.train_problems()[:problems]
        t = time.perf_counter()
        groups = asyncio.run(run_groups(env, [address], chosen, n, env_config.sampling))
        sample_s = time.perf_counter() - t
    finally:
        server.stop()
    rollouts = [r for g in groups for r in g.rollouts]
    sequences = [Sequence.from_rollout(r, 0.0) for r in rollouts]
    row_len = config.batcher.max_seq_len
    batch, placed = pack(sequences, len(sequences), row_len)
    assert len(placed) == len(sequences), "every sampled episode fits a row of batcher.max_seq_len"
    t = time.perf_counter()
    learner_lp = learner.logprobs(batch)
    learner_s = time.perf_counter() - t
    diff = np.abs(learner_lp - batch.sampler_logprobs)[batch.loss_mask]
    return {
        "episodes": len(rollouts),
        "tokens": int(diff.size),
        "mean_abs": float(diff.mean()),
        "max_abs": float(diff.max()),
        "p99_abs": float(np.quantile(diff, 0.99)),
        "reward": float(np.mean([r.reward for r in rollouts])),
        "build_s": build_s,
        "sample_s": sample_s,
        "learner_s": learner_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "experiments", "smollm2_math.yaml"))
    parser.add_argument("--env", default=None, help="environment name (default: the config's first)")
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=None, help="episodes per problem (default: the env's)")
    parser.add_argument("--smoke", action="store_true", help="the quickstart's tiny model on a few problems")
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.problems = os.path.join(ROOT, "experiments", "quickstart_local.yaml"), 4
    result = measure(args.config, args.env, args.problems, args.group_size)
    print(f"config: {os.path.relpath(args.config, ROOT)}")
    print(
        f"{result['episodes']} episodes, {result['tokens']} sampled tokens, reward {result['reward']:.3f}; "
        f"sampled in {result['sample_s']:.1f}s (first call compiles), learner logprobs in {result['learner_s']:.1f}s"
    )
    print(f"mean |Δ logprob| {result['mean_abs']:.3e}, p99 {result['p99_abs']:.3e}, max {result['max_abs']:.3e}")
    print(f"max_abs_dlogprob={result['max_abs']:.12f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
