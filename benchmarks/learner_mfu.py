"""Learner MFU: achieved training FLOP/s of the learner on packed rows over the peak matmul FLOP/s of the same device.

    python benchmarks/learner_mfu.py               # 1 device, then 4 simulated devices (information only)
    python benchmarks/learner_mfu.py --ablation    # also the learner with each speed option of ModelConfig off

Model: Llama, hidden 512, 4 layers, 8 heads, mlp 2048, vocab 1024, seq 512, 16 packed rows of 4 rollouts each (8192
tokens per step), the learner's defaults (one optimizer step per batch, the RL loss and its metrics).

FLOPs per trained token, counted from the model rather than measured: 6·N for the N parameters of the linear layers
(attention projections, MLP, LM head; the input embedding is a lookup) plus the attention matmuls 12·L·seq·hidden
(scores and values, forward and backward, over the full `seq`-token context, as in PaLM's MFU). Recomputation and
non-matmul work count as nothing. The benchmark checks this count against Levanter's
`LlamaConfig.flops_per_token` (which adds a small mask term).

Peak: a warmed-up f32 2048×2048 @ 2048×2048 `jnp.dot` (2·n³ FLOPs), the best of 8 (about a second), timed right
after every learner step, so that other jobs on a shared machine weigh on both alike. MFU is the median over steps of
(achieved FLOP/s of the step) / (peak of the dots timed after it); the ratio of the median step to the best dot of
the whole run is printed too (a lower bound when the machine is shared). The last line is `mfu=<value>` (1 device).
`--smoke` measures a tiny model for one step (seconds; the test suite runs it so the benchmark cannot break
unnoticed; its figure means nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
from model_size import packed_batch

HIDDEN, LAYERS, HEADS, MLP, VOCAB, SEQ, ROWS = 512, 4, 8, 2048, 1024, 512, 16
DOT_N = 2048


def architecture():
    from levanter.models.llama import LlamaConfig

    return LlamaConfig(
        max_seq_len=SEQ,
        hidden_dim=HIDDEN,
        intermediate_dim=MLP,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=HEADS,
        gradient_checkpointing=False,
        scan_layers=True,
        tie_word_embeddings=False,
    )


def train_flops_per_token(model) -> tuple[float, float]:
    """(6·N + attention FLOPs per token, from the model's linear layers; Levanter's count for the same model)."""
    import haliax.nn as hnn
    import jax

    leaves = jax.tree_util.tree_leaves(model, is_leaf=lambda x: isinstance(x, hnn.Linear))
    n = sum(x.weight.array.size for x in leaves if isinstance(x, hnn.Linear))
    arch = model.config
    attention = 12 * arch.num_layers * arch.max_seq_len * arch.num_heads * arch.actual_head_size
    return 6 * n + attention, 3 * arch.flops_per_token(VOCAB, arch.max_seq_len)


def peak_matmul_flops(a, b, reps: int = 8) -> float:
    """FLOP/s of the best of `reps` timed `a @ b` (square, already compiled)."""
    import jax.numpy as jnp

    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jnp.dot(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * a.shape[0] ** 3 / best


VARIANTS = {
    "default": {},
    "layout_aware_gradients=false": {"layout_aware_gradients": False},
    "cpu_attention_block_size=null": {"cpu_attention_block_size": None},
    "both off": {"layout_aware_gradients": False, "cpu_attention_block_size": None},
}


def measure(steps: int, variants: list[str]) -> dict:
    """Per variant: step times and the peak of the dot timed after each step (variants interleaved step by step)."""
    import jax
    import jax.numpy as jnp

    from marin_rl.learner.config import LearnerConfig
    from marin_rl.learner.learner import Learner
    from marin_rl.model.config import ModelConfig

    a = jax.random.normal(jax.random.PRNGKey(0), (DOT_N, DOT_N), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(1), (DOT_N, DOT_N), jnp.float32)
    jnp.dot(a, b).block_until_ready()  # compile
    rng = np.random.default_rng(0)
    batches = [packed_batch(rng, ROWS, SEQ, VOCAB) for _ in range(steps + 1)]
    learners = {}
    for name in variants:
        config = ModelConfig(architecture=architecture(), **VARIANTS[name])
        learner = Learner(config, LearnerConfig(), VOCAB)
        t = time.perf_counter()
        learner.train_step(batches[0])  # compile
        print(f"  [{name}] compile + first step {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        learners[name] = learner
    flops, levanter_flops = train_flops_per_token(next(iter(learners.values())).model)
    out = {name: {"step_s": [], "peak": []} for name in variants}
    for i in range(steps):
        for name, learner in learners.items():
            t = time.perf_counter()
            learner.train_step(batches[1 + i])
            out[name]["step_s"].append(time.perf_counter() - t)
            out[name]["peak"].append(peak_matmul_flops(a, b))
    tokens = ROWS * SEQ
    for r in out.values():
        steps_s, peaks = np.array(r["step_s"]), np.array(r["peak"])
        achieved = flops * tokens / steps_s
        r.update(
            step_median_s=float(np.median(steps_s)),
            achieved=float(np.median(achieved)),
            peak_median=float(np.median(peaks)),
            mfu=float(np.median(achieved / peaks)),
            mfu_all=[float(x) for x in achieved / peaks],
            peak_best=float(np.max(peaks)),
            mfu_vs_best_peak=float(np.median(achieved) / np.max(peaks)),
        )
    first = next(iter(learners.values()))
    return {
        "devices": jax.device_count(),
        "params": first.num_params,
        "train_flops_per_token": flops,
        "levanter_flops_per_token": levanter_flops,
        "variants": out,
    }


def report(r: dict) -> None:
    for name, v in r["variants"].items():
        label = f"{r['devices']} device(s)" + ("" if name == "default" else f", {name}")
        print(
            f"{label}: step {v['step_median_s']:.2f} s (median of {len(v['step_s'])}) on {ROWS}×{SEQ} tokens -> "
            f"{v['achieved'] / 1e9:.1f} GFLOP/s; peak matmul {v['peak_median'] / 1e9:.1f} GFLOP/s; "
            f"MFU {v['mfu']:.3f} (per step: {', '.join(f'{x:.3f}' for x in v['mfu_all'])}; against the run's best "
            f"dot, {v['peak_best'] / 1e9:.1f} GFLOP/s: {v['mfu_vs_best_peak']:.3f})"
        )


def use_smoke_sizes() -> None:
    """Shrink the model, batch and peak dot to a size that runs in seconds."""
    global HIDDEN, LAYERS, HEADS, MLP, VOCAB, SEQ, ROWS, DOT_N
    HIDDEN, LAYERS, HEADS, MLP, VOCAB, SEQ, ROWS, DOT_N = 64, 1, 2, 128, 256, 64, 4, 256


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps on 1 device (after a compile step)")
    parser.add_argument("--steps-4", type=int, default=3, help="timed steps on 4 simulated devices (0: skip)")
    parser.add_argument("--ablation", action="store_true", help="also time the learner with speed options off")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one step (seconds): checks it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        use_smoke_sizes()
        args.steps, args.steps_4 = 1, min(args.steps_4, 1)
    variants = list(VARIANTS) if args.ablation else ["default"]
    if args.worker:
        print(json.dumps(measure(args.steps, variants)))
        return
    print(
        f"model: llama hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads, mlp {MLP}, vocab {VOCAB}; "
        f"{ROWS} packed rows × {SEQ} (4 rollouts per row)"
    )
    one = measure(args.steps, variants)
    ours, levanter = one["train_flops_per_token"], one["levanter_flops_per_token"]
    if not args.smoke:  # Levanter's small mask term is not negligible at smoke sizes
        assert abs(ours - levanter) <= 0.005 * levanter, (ours, levanter)
    n_linear = (ours - 12 * LAYERS * SEQ * HIDDEN) // 6
    print(
        f"FLOPs: 6·N + 12·L·seq·hidden = {ours / 1e6:.1f} MFLOP per token (N = {n_linear:,} linear-layer parameters "
        f"of {one['params']:,}; Levanter's count: {levanter / 1e6:.1f}); peak: f32 {DOT_N}³ jnp.dot after every step"
    )
    report(one)
    if args.steps_4 > 0:
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
        cmd = [sys.executable, __file__, "--worker", "--steps", str(args.steps_4)] + ["--smoke"] * args.smoke
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"4 simulated devices: failed\n{proc.stderr[-3000:]}")
        else:
            report(json.loads(proc.stdout.strip().splitlines()[-1]))
            print("(4 simulated devices: data=4 over the same CPU cores, with collectives; information only)")
    print(f"mfu={one['variants']['default']['mfu']:.4f}")


if __name__ == "__main__":
    main()
