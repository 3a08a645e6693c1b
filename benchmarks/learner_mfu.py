"""Learner MFU: achieved training FLOP/s of the learner on packed rows over the peak matmul FLOP/s of the same device.

    python benchmarks/learner_mfu.py            # 1 device, then 4 simulated devices (information only)

Model: Llama, hidden 512, 4 layers, 8 heads, mlp 2048, vocab 1024, seq 512, 16 packed rows (8192 tokens per step).
FLOPs per token: Levanter's `LlamaConfig.flops_per_token(vocab)` (forward: matmuls of projections, MLP, attention
scores/values over the full seq_len, lm head); training = 3 × forward (forward + backward). Peak: a warmed-up f32
2048×2048 @ 2048×2048 `jnp.dot`, best of several reps, 2·n³ FLOPs each. The last line is `mfu=<value>` (1 device).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

HIDDEN, LAYERS, HEADS, MLP, VOCAB, SEQ, ROWS = 512, 4, 8, 2048, 1024, 512, 16
STEPS = 3


def peak_matmul_flops(n: int = 2048, reps: int = 5) -> float:
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, b).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dot(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def packed_batch(rng):
    from marin_rl.types import PackedBatch

    segs = np.zeros((ROWS, SEQ), np.int32)
    pos = np.zeros((ROWS, SEQ), np.int32)
    for r in range(ROWS):  # four rollouts per row, filling it
        cuts = [0, *sorted(rng.choice(np.arange(32, SEQ - 32), 3, replace=False)), SEQ]
        for s in range(4):
            segs[r, cuts[s] : cuts[s + 1]] = s
            pos[r, cuts[s] : cuts[s + 1]] = np.arange(cuts[s + 1] - cuts[s])
    mask = pos >= 16
    return PackedBatch(
        input_ids=rng.integers(0, VOCAB, (ROWS, SEQ)).astype(np.int32),
        position_ids=pos,
        segment_ids=segs,
        loss_mask=mask,
        advantages=np.where(mask, rng.normal(size=(ROWS, SEQ)), 0).astype(np.float32),
        policy_logprobs=np.where(mask, -np.log(VOCAB), 0).astype(np.float32),
        version=np.where(mask, 0, -1).astype(np.int32),
    )


def measure() -> dict:
    import jax
    from levanter.models.llama import LlamaConfig

    from marin_rl.learner.learner import Learner, LearnerConfig
    from marin_rl.learner.model import ModelConfig

    arch = LlamaConfig(
        seq_len=SEQ,
        hidden_dim=HIDDEN,
        intermediate_dim=MLP,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=HEADS,
        gradient_checkpointing=False,
        scan_layers=True,
        tie_word_embeddings=False,
    )
    learner = Learner(ModelConfig(architecture=arch), LearnerConfig(), VOCAB)
    rng = np.random.default_rng(0)
    batches = [packed_batch(rng) for _ in range(STEPS + 1)]
    learner.train_step(batches[0])  # compile
    times = []
    for b in batches[1:]:
        t = time.perf_counter()
        learner.train_step(b)
        times.append(time.perf_counter() - t)
    step = float(np.median(times))
    flops_per_token = 3 * arch.flops_per_token(VOCAB)
    achieved = flops_per_token * ROWS * SEQ / step
    peak = peak_matmul_flops()
    return {
        "devices": jax.device_count(),
        "params": learner.num_params,
        "step_s": step,
        "train_flops_per_token": flops_per_token,
        "achieved": achieved,
        "peak": peak,
        "mfu": achieved / peak,
    }


def report(r: dict) -> None:
    print(
        f"{r['devices']} device(s): step {r['step_s']:.3f} s on {ROWS}×{SEQ} tokens, "
        f"{r['train_flops_per_token'] / 1e6:.1f} MFLOP/token -> {r['achieved'] / 1e9:.1f} GFLOP/s; "
        f"peak matmul {r['peak'] / 1e9:.1f} GFLOP/s; MFU {r['mfu']:.3f}"
    )


def main() -> None:
    if "--worker" in sys.argv:
        print(json.dumps(measure()))
        return
    print(
        f"model: llama hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads, mlp {MLP}, vocab {VOCAB}; "
        f"{ROWS} packed rows × {SEQ}"
    )
    print("FLOPs: 3 × LlamaConfig.flops_per_token(vocab) per token (forward + backward); peak: f32 2048³ jnp.dot")
    one = measure()
    report(one)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, __file__, "--worker"], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"4 simulated devices: failed\n{proc.stderr[-3000:]}")
    else:
        four = json.loads(proc.stdout.strip().splitlines()[-1])
        report(four)
        print("(4 simulated devices share the same CPU cores; information only)")
    print(f"mfu={one['mfu']:.4f}")


if __name__ == "__main__":
    main()
