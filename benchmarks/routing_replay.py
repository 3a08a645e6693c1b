"""Routing replay: the sampler-learner mismatch of a mixture-of-experts policy with and without it, at float32 and
bfloat16.

A mixture of experts sends each token to its router's top k experts. Where two experts nearly tie, the sampler and the
learner (another batch shape, another kernel, bfloat16) may choose differently for the same token, and their logprobs
then differ by far more than numerics: the importance ratios of RL's loss explode. Routing replay
(`learner.moe.routing_replay`, `marin_rl.model.moe`) routes the learner's forward by the experts the sampler recorded.

This builds the config's mixture-of-experts policy (experiments/quickstart_moe.yaml: a tiny Qwen3-MoE) with its
router's weights scaled by `--router-scale` (small: near-uniform router probabilities, so near-ties abound), samples
groups of the config's environment with the embedded dense engine recording the routing, packs them as the batcher
does, and recomputes every sampled token's logprob with the learner, routing freely and routing by the record, in
float32 and in bfloat16 (engine and learner alike). Per mode it prints the gap x = learner − sampler logprob over the
sampled tokens (max and mean |x|, the share over 0.1) and the loss's mismatch metrics (`marin_rl.learner.losses`:
`mismatch/kl_k3` = mean(exp(x) − 1 − x), per-rollout ratio ρ = exp(Σ x): `seq_ratio/max`, `chi2_seq` =
mean(ρ²) − 1).

    python benchmarks/routing_replay.py [--problems 32] [--router-scale 0.1]

The last line is `replayed_over_free=` the bfloat16 max |x| with replay over without it (smaller is better).
`--smoke` runs a few problems, in seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _scaled_router(model, scale: float):
    """`model` with its expert layers' router weights multiplied by `scale`."""
    import equinox as eqx

    from marin_rl.model.moe import sparse_block

    def gate(m):
        return sparse_block(m.transformer.layers.stacked).gate.weight

    return eqx.tree_at(gate, model, gate(model) * scale)


def _sample(config, env, env_config, learner, tokenizer, problems: int, dtype: str):
    """Groups of `problems` problems sampled by an embedded dense engine computing in `dtype`, routing recorded."""
    from marin_rl.inference.levanter_server import LevanterInferenceServer
    from marin_rl.inference.local_client import InProcessPolicyClient

    server = LevanterInferenceServer(learner.model, tokenizer, config.inference, compute_dtype=dtype)
    server.apply_weights(0, learner.weights())
    server.start()
    try:

        async def episodes():
            client = InProcessPolicyClient(server, routed_experts=True)
            chosen = env.train_problems()[:problems]
            return await asyncio.gather(
                *(env.run_group(client, p, env_config.group_size, env_config.sampling) for p in chosen)
            )

        return [r for g in asyncio.run(episodes()) for r in g.rollouts]
    finally:
        server.stop()


def _mismatch(x: np.ndarray, mask: np.ndarray, segments: np.ndarray) -> dict[str, float]:
    """The gap statistics of learner − sampler logprobs `x` over the sampled tokens (`mask`), per rollout by
    (row, `segments`)."""
    gap = np.abs(x[mask])
    log_rho = {}
    for (row, seg), v in zip(zip(*np.nonzero(mask), strict=True), x[mask], strict=True):
        key = (row, segments[row, seg])
        log_rho[key] = log_rho.get(key, 0.0) + float(v)
    rho = np.exp(np.clip(np.asarray(list(log_rho.values())), -20, 20))
    return {
        "max_abs": float(gap.max()),
        "mean_abs": float(gap.mean()),
        "over_0.1": float((gap > 0.1).mean()),
        "kl_k3": float(np.mean(np.expm1(x[mask]) - x[mask])),
        "seq_ratio_max": float(rho.max()),
        "chi2_seq": float(np.mean(rho * rho) - 1.0),
    }


def measure(config_path: str, problems: int, router_scale: float, dtypes: list[str]) -> dict:
    """Per dtype: the rollouts' size and the mismatch with free and with replayed routing."""
    from marin_rl.config import make_environment, parse_config
    from marin_rl.learner.config import MoeConfig
    from marin_rl.learner.learner import Learner
    from marin_rl.replay.packing import Sequence, pack
    from marin_rl.tokenizer import load_tokenizer

    out = {}
    for dtype in dtypes:
        config = parse_config(["--config", config_path, "--model.compute_dtype", dtype])
        config.configure_jax()
        env_config = config.envs[0]
        tokenizer = load_tokenizer(config.tokenizer)
        env = make_environment(
            env_config, tokenizer, seed=config.orchestrator.seed, max_seq_len=config.batcher.max_seq_len
        )
        learners = {}
        for replay in (False, True):
            learner_config = dataclasses.replace(config.learner, moe=MoeConfig(routing_replay=replay))
            learner = Learner(config.model, learner_config, len(tokenizer), temperature=env_config.sampling.temperature)
            learner.model = _scaled_router(learner.model, router_scale)
            learners[replay] = learner
        t = time.perf_counter()
        rollouts = _sample(config, env, env_config, learners[True], tokenizer, problems, dtype)
        sample_s = time.perf_counter() - t
        sequences = [Sequence.from_rollout(r, 0.0) for r in rollouts]
        batch, placed = pack(sequences, len(sequences), config.batcher.max_seq_len)
        assert len(placed) == len(sequences), "every sampled episode fits a row of batcher.max_seq_len"
        row = {"rollouts": len(rollouts), "tokens": int(batch.loss_mask.sum()), "sample_s": sample_s}
        for replay, learner in learners.items():
            x = learner.logprobs(batch) - batch.sampler_logprobs
            row["replayed" if replay else "free"] = _mismatch(x, batch.loss_mask, batch.segment_ids)
        out[dtype] = row
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "experiments", "quickstart_moe.yaml"))
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--router-scale", type=float, default=0.1, help="multiplies the router's weights")
    parser.add_argument("--smoke", action="store_true", help="a few problems")
    args = parser.parse_args(argv)
    if args.smoke:
        args.problems = 2
    result = measure(args.config, args.problems, args.router_scale, ["float32", "bfloat16"])
    print(f"config: {os.path.relpath(args.config, ROOT)}, router weights × {args.router_scale}")
    header = (
        f"{'dtype':9} {'routing':9} {'max|x|':>9} {'mean|x|':>9} {'>0.1':>7} {'kl_k3':>9} {'ρ max':>9} {'chi2_seq':>9}"
    )
    print(header)
    for dtype, row in result.items():
        print(
            f"# {dtype}: {row['rollouts']} rollouts, {row['tokens']} sampled tokens "
            f"(sampled in {row['sample_s']:.1f}s, compiling included)"
        )
        for mode in ("free", "replayed"):
            m = row[mode]
            print(
                f"{dtype:9} {mode:9} {m['max_abs']:9.2e} {m['mean_abs']:9.2e} {m['over_0.1']:9.2%} {m['kl_k3']:9.2e} "
                f"{m['seq_ratio_max']:9.3f} {m['chi2_seq']:9.2e}"
            )
    bf16 = result["bfloat16"]
    ratio = bf16["replayed"]["max_abs"] / max(bf16["free"]["max_abs"], 1e-12)
    print(f"replayed_over_free={ratio:.6f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
