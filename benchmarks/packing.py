"""Packing benchmark: the token-budget batcher against padding each rollout to the batch's longest.

Three environments produce rollouts whose lengths are log-normal, clipped to [32, 4096] tokens. Before each batch
every replay buffer is topped up with new groups (8 rollouts each) to `--supply` times its share of the budget, as
if generation kept pace; then the batcher makes a batch. Printed, measured in the same run:

- packing efficiency (real tokens / token slots) of the batcher's batches, and of the same rollouts padded to
  the longest one (one rollout per row: what systems without packing do);
- the batcher's time per batch, the learner's step time on such a batch (the quickstart model, tiny Llama, at
  seq_len = max_seq_len), and their ratio.

The last line is `packing_efficiency=<value>`. Run: `python benchmarks/packing.py [--rows 8] [--batches 30]`;
`--smoke` runs a few small batches in seconds (the test suite does, so the benchmark cannot break unnoticed).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time

import numpy as np

from marin_rl.replay.batcher import Batcher, BatcherConfig, FormedBatch
from marin_rl.replay.buffer import ReplayBuffer, ReplayConfig
from marin_rl.types import InferenceMetadata, Rollout, RolloutGroup, Turn

ENVS = {  # name: (median length, log-normal sigma, batch fraction)
    "math": (400, 0.8, 0.4),
    "code": (1200, 0.7, 0.4),
    "chat": (200, 1.0, 0.2),
}
MIN_LEN, MAX_LEN = 32, 4096


def make_group(env: str, version: int, rng: np.random.Generator, size: int = 8) -> RolloutGroup:
    """A group of `size` rollouts with log-normal lengths in [32, 4096]; token ids in [8, 100)."""
    median, sigma, _ = ENVS[env]
    problem = f"{env}-{rng.integers(1 << 30)}"
    prompt_len = int(np.clip(rng.lognormal(np.log(median * 0.25), 0.5), 8, MIN_LEN - 1))
    prompt = rng.integers(8, 100, prompt_len).tolist()
    rollouts = []
    for _ in range(size):
        n = int(np.clip(rng.lognormal(np.log(median), sigma), MIN_LEN, MAX_LEN))
        gen = rng.integers(8, 100, n - prompt_len).tolist()
        meta = InferenceMetadata(server="bench", version_start=version, version_end=version)
        turns = [
            Turn("user", "", list(prompt), timestamp=0.0),
            Turn(
                "assistant",
                "",
                gen,
                sampler_logprobs=[-0.5] * len(gen),
                reward=float(rng.random() < 0.5),
                inference_metadata=meta,
                timestamp=0.0,
            ),
        ]
        rollouts.append(Rollout(env, problem, turns))
    return RolloutGroup(env, problem, rollouts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8, help="rows per batch (budget = rows × seq_len)")
    parser.add_argument("--seq-len", type=int, default=4096, help="max_seq_len of a packed row")
    parser.add_argument("--batches", type=int, default=30, help="batches made to measure packing")
    parser.add_argument("--supply", type=float, default=1.5, help="buffer top-up before each batch, × share")
    parser.add_argument("--learner-steps", type=int, default=2, help="timed learner steps (after one to compile)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a few small batches (seconds): checks it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.batches, args.learner_steps, args.seq_len = 2, 3, 1, 1024
    logging.basicConfig(level=logging.WARNING)
    rng = np.random.default_rng(args.seed)

    budget = args.rows * args.seq_len
    buffers = {
        n: ReplayBuffer(n, ReplayConfig(max_age=4, capacity=1 << 20), vocab_size=128, max_tokens=args.seq_len)
        for n in ENVS
    }
    batcher = Batcher(
        BatcherConfig(total_token_budget=budget, max_seq_len=args.seq_len),
        buffers,
        {n: f for n, (_, _, f) in ENVS.items()},
    )
    eff, padded, times, batches = [], [], [], []
    shares = {n: [] for n in ENVS}
    for version in range(args.batches):
        for n, (_, _, f) in ENVS.items():
            while buffers[n].num_tokens < args.supply * f * budget:
                buffers[n].admit(make_group(n, version, rng))
        t = time.perf_counter()
        made = batcher.try_make_batch(version)
        times.append(time.perf_counter() - t)
        assert isinstance(made, FormedBatch), f"batcher blocked: {made}"
        batch, m = made.batch, made.metrics
        eff.append(m["batches/packing_efficiency"])
        lens = [it.num_tokens for it, _ in made.placed]
        padded.append(sum(lens) / (len(lens) * max(lens)))
        for n in ENVS:
            shares[n].append(m[f"batches/{n}/tokens_used"] / budget)
        if len(batches) < args.learner_steps + 1:
            batches.append(batch)

    print(
        f"{args.batches} batches of {args.rows} rows × {args.seq_len} tokens from {len(ENVS)} envs "
        f"(log-normal lengths in [{MIN_LEN}, {MAX_LEN}], medians "
        + ", ".join(f"{n} {m}" for n, (m, _, _) in ENVS.items())
        + ")"
    )
    for n, (_, _, f) in ENVS.items():
        print(f"  share of {n}: target {f:.3f}, got mean {np.mean(shares[n]):.4f} (min {np.min(shares[n]):.4f})")
    print(f"padded-to-longest efficiency: {np.mean(padded):.4f} (min {np.min(padded):.4f})")
    print(f"batcher packing efficiency:   {np.mean(eff):.4f} (min {np.min(eff):.4f})")
    batcher_s = float(np.median(times))
    print(f"batcher time per batch:       {batcher_s * 1e3:.1f} ms (median; max {max(times) * 1e3:.1f} ms)")

    if args.learner_steps > 0:
        from marin_rl.learner.config import LearnerConfig
        from marin_rl.learner.learner import Learner
        from marin_rl.model.config import ModelConfig, tiny_llama

        arch = dataclasses.replace(tiny_llama(), max_seq_len=args.seq_len)
        learner = Learner(ModelConfig(architecture=arch), LearnerConfig(), vocab_size=128)
        t = time.perf_counter()
        learner.train_step(batches[0])
        compile_s = time.perf_counter() - t
        steps = []
        for b in batches[1 : args.learner_steps + 1]:
            t = time.perf_counter()
            learner.train_step(b)
            steps.append(time.perf_counter() - t)
        step_s = float(np.median(steps))
        print(
            f"learner step (tiny Llama):    {step_s:.2f} s (median of {len(steps)}; first step with compile "
            f"{compile_s:.1f} s)"
        )
        print(f"batcher time / learner step:  {batcher_s / step_s:.4f}")
    print(f"packing_efficiency={np.mean(eff):.4f}")


if __name__ == "__main__":
    main()
