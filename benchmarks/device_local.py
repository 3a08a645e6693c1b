"""A local-backend run on the device JAX finds (a GPU, a TPU host, or the CPU): tokens per second, the learner's MFU,
the weight hand-over per version, and memory per phase.

    python benchmarks/device_local.py --config experiments/gpu_local.yaml [--steps N] [-- OVERRIDES...]
    python benchmarks/device_local.py --smoke      # the quickstart's local config, a few steps (seconds)

The run is `python -m marin_rl.run --config <config>` (it must use `orchestrator.backend: local`: the learner, the
embedded engine sampling from the learner's own arrays and the env workers in one process), launched as a subprocess
so that it owns the device. After it exits, this process times the device's matmul peak, the baseline of the MFU
figure, measured in the same run on the same device: the best of ten square `a @ b` products at the learner's dtype
(float32, JAX's default precision) and, for reference, in bfloat16.

Printed:
- the run's parts as `benchmarks/colocated.py` prints them: start-up, time to `--reward`, steps 1 -> N, per step
  (learner step, generation inside the engine's calls, hand-over, the driver's host work), held-out reward by step;
- tokens per second: generated (sampled by the engine, over wall time) and trained (the learner's real tokens over
  its step time), medians over steps;
- learner MFU: trained tokens per second × training FLOPs per token (3 × Levanter's forward count
  `flops_per_token(vocab, seq)`: 6·N for the linear layers plus attention over the whole `seq`-token row) over the
  float32 peak, and the same achieved FLOP/s over the bfloat16 peak;
- hand-over per version: bytes copied and seconds (publish + apply), and resident copies of the policy;
- memory per phase: the device's bytes in use while the engine samples (the driver's per-step reading) and right
  after each train step, the device's peak, and the process's resident memory (devices that report no memory
  statistics, like the CPU, give the process's figures only).

The last line is `mfu=<value>` (against the float32 peak). `--smoke` runs the quickstart's local config for a few
steps in seconds (the test suite runs it so the benchmark cannot break unnoticed; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

from colocated import EXPERIMENTS, ROOT, describe, run, smoke_config


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def train_flops_per_token(config_path: str, overrides: list[str], output_dir: str) -> tuple[float, int, int]:
    """(training FLOPs per trained token, vocabulary size, parameters) of the run's model: 3 × Levanter's forward
    count over the model's `max_seq_len`; the vocabulary is read from the run's exported Hugging Face config."""
    from marin_rl.config import parse_config

    cfg = parse_config(["--config", config_path, "--output_dir", output_dir, *overrides])
    arch = cfg.model.architecture
    exports = sorted(glob.glob(os.path.join(output_dir, "hf", "step-*", "config.json")))
    if not exports:
        raise SystemExit(f"no Hugging Face export under {output_dir}/hf: the run's vocabulary size is unknown")
    with open(exports[-1]) as f:
        vocab = int(json.load(f)["vocab_size"])
    params = arch.total_trainable_params(vocab) if hasattr(arch, "total_trainable_params") else 0
    return 3.0 * arch.flops_per_token(vocab, arch.max_seq_len), vocab, int(params)


def matmul_peak(n: int, dtype: str, reps: int = 10) -> float:
    """FLOP/s of the best of `reps` timed n×n @ n×n products on the default device (compiled first)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32).astype(dtype)
    dot = jax.jit(jnp.dot)
    dot(a, b).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dot(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


def memory_by_phase(rows: list[dict]) -> dict[str, float]:
    """Medians over steps of every `memory/...` figure the run logged, and the maxima of the peaks."""
    keys = sorted({k for r in rows for k in r if k.startswith("memory/")})
    out = {}
    for k in keys:
        values = [r[k] for r in rows if k in r]
        out[k] = max(values) if "peak" in k else statistics.median(values)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.path.join(EXPERIMENTS, "quickstart_local.yaml"))
    parser.add_argument("--steps", type=int, default=None, help="learner steps (default: the config's)")
    parser.add_argument("--reward", type=float, default=0.8, help="held-out reward for the time-to-reward figure")
    parser.add_argument("--output-dir", default=None, help="where the run writes (default: a temporary dir)")
    parser.add_argument("--peak-n", type=int, default=None, help="matmul size for the peak (default: 8192; CPU 2048)")
    parser.add_argument("--smoke", action="store_true", help="a few steps of the quickstart's local config (seconds)")
    parser.add_argument("overrides", nargs="*", help="more `--key value` overrides for the run (after `--`)")
    args = parser.parse_args()
    out = args.output_dir or tempfile.mkdtemp(prefix="device-local-bench-")
    run_dir = os.path.join(out, "run")
    if os.path.isdir(os.path.join(run_dir, "checkpoints")):
        raise SystemExit(f"--output-dir {out} holds a run ({run_dir}): it would resume, not run; give a new one")
    config = smoke_config(args.config, tempfile.mkdtemp(prefix="device-local-smoke-")) if args.smoke else args.config
    overrides = ["--tracking.wandb_mode", "disabled", *args.overrides]
    steps = args.steps or (3 if args.smoke else None)
    if steps is not None:
        overrides += ["--orchestrator.num_steps", str(steps)]
    if args.smoke:
        overrides += ["--orchestrator.eval_every", "0", "--checkpoint.every", "0"]
    launch, end, rows, summary = run(config, run_dir, overrides)
    figures = describe(os.path.basename(config), launch, end, rows, args.reward)
    stepped = [r for r in rows if r.get("step", 0) >= 1 and "learner/step_time_s" in r]

    # Only now does this process touch the device (the run has exited and released it).
    import jax

    device = jax.devices()[0]
    flops_per_token, vocab, params = train_flops_per_token(config, overrides, run_dir)
    n = args.peak_n or (256 if args.smoke else 2048 if device.platform == "cpu" else 8192)
    peak_f32, peak_bf16 = matmul_peak(n, "float32"), matmul_peak(n, "bfloat16")
    trained_tps = _median(stepped, "learner/tokens_per_s") or 0.0
    generated_tps = _median(stepped, "throughput/generated_tokens_per_s") or 0.0
    achieved = trained_tps * flops_per_token
    mfu = achieved / peak_f32
    print(f"device: {device.platform} {device.device_kind} ×{jax.device_count()}, jax {jax.__version__}")
    print(
        f"model: {params / 1e6:.1f}M parameters, vocabulary {vocab}, {flops_per_token / 1e6:.1f} MFLOP per trained "
        f"token; whole run {summary.get('wall_time_s', 0):.1f} s, {summary.get('generated_tokens', 0)} tokens "
        f"generated, {summary.get('trained_tokens', 0)} trained"
    )
    print(
        f"tokens per second (median over steps): generated {generated_tps:,.0f}; trained by the learner "
        f"{trained_tps:,.0f} (its step time {figures['learner_s'] * 1000:.1f} ms)"
    )
    print(
        f"learner MFU: {achieved / 1e12:.3f} TFLOP/s achieved; float32 peak {peak_f32 / 1e12:.1f} TFLOP/s "
        f"({n}×{n} matmul) -> MFU {mfu:.4f}; bfloat16 peak {peak_bf16 / 1e12:.1f} TFLOP/s -> "
        f"{achieved / peak_bf16:.4f}"
    )
    resident = [r["broadcast/resident_policy_bytes"] for r in rows if "broadcast/resident_policy_bytes" in r]
    policy = max((r["broadcast/policy_bytes"] for r in rows if "broadcast/policy_bytes" in r), default=0)
    copies = f"{max(resident) / policy:.2f}" if resident and policy else "not measured"
    print(
        f"hand-over per version: {figures['handover_bytes']:.0f} bytes copied in {figures['handover_s'] * 1000:.2f} "
        f"ms; policy {policy / 1e6:.1f} MB; resident copies of the policy {copies}"
    )
    memory = memory_by_phase(stepped)
    labels = {
        "memory/device_mb": "device in use while sampling",
        "memory/device_mb/after_train": "device in use after a train step",
        "memory/device_peak_mb": "device peak",
        "memory/host_rss_mb": "process resident while sampling",
        "memory/host_rss_mb/after_train": "process resident after a train step",
        "memory/host_peak_mb": "process peak",
    }
    print(
        "memory (MB; medians over steps, peaks as maxima): "
        + "; ".join(f"{labels[k]} {v:,.0f}" for k, v in memory.items() if k in labels)
    )
    print(f"mfu={mfu:.6f}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
