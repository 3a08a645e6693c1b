"""Model size on paper and on the device: memory and time per configuration, and a few measured learner steps.

    python benchmarks/model_size.py                      # the paper table for every preset and device
    python benchmarks/model_size.py --measure qwen-100m  # learner steps of a preset here, against the paper
    python benchmarks/model_size.py --smoke              # a tiny preset, one step (seconds)

Presets are the published shapes of the models people fine-tune (Qwen2.5 0.5B, 1.5B and 7B, Llama 3 8B) and a
~100M-parameter Qwen-shaped model (GQA, qkv bias, tied embeddings) small enough to train on a laptop CPU.

The paper model, for full fine-tuning with the learner's defaults (float32 parameters and compute, AdamW):
- parameters P = 4 bytes × N, gradients 4N, AdamW's two moments 8N (optax keeps them in the parameters' dtype);
- activations per trained token of a microbatch: without rematerialisation each layer keeps about
  4·hidden + 2·(heads·head_dim) + 2·(kv_heads·head_dim) + 4·mlp floats for its backward (the norms' inputs and
  outputs, q/k/v, the attention output, the MLP's gate, up and product; attention itself is blockwise, so no
  seq² scores are kept), plus 5·vocab floats at the head (the logits, their temperature-scaled copy, log-softmax,
  softmax and the logits' gradient: the count that brings the paper within ±12% of three measured sizes); with
  gradient checkpointing a layer keeps only its input (hidden floats) and one layer's internals live at a time;
- the KV cache of generation: 2 · layers · kv_heads · head_dim · bytes (inference.levanter.kv_cache_dtype) per
  token of `max_seqs × max_seq_len`; the colocated engine samples from the learner's own arrays (no second copy);
- training time: tokens/s = MFU × peak / FLOPs per token, FLOPs = 6·N_linear + 12·layers·seq·heads·head_dim
  (PaLM's count; N_linear includes the LM head, tied or not; with checkpointing the device does 8·N_linear of work
  for the same 6·N_linear counted);
- generation time (decode is bound by memory): each decode step reads the parameters and the batch's KV cache,
  so tokens/s = batch / ((P + batch × cache per sequence) / bandwidth), capped by 2·N FLOPs per token at peak.

Devices on paper: one H100 80GB (as measured on one: 370 TFLOP/s for a float32 matmul at JAX's default precision,
which is TF32, and 3.0 TB/s for a device-to-device copy; the datasheet says 495 and 3.35) and a TPU v5e-8 (8 chips
of 197 TFLOP/s bf16, 16 GiB and 819 GB/s each; FSDP over the 8 chips divides parameters, gradients and optimizer
state by 8; f32 matmuls run as bf16 passes at the default precision). MFU for the table is `--mfu`.

`--measure PRESET` builds the preset at random initialisation and runs `--steps` learner steps (the RL loss on
packed rows of 4 rollouts each) in a subprocess that owns the device: step time (median), trained tokens/s, MFU
against the device's matmul peak timed in the same process right after (f32 at JAX's default precision, and bf16
for reference), the device's peak bytes in use (or, on a CPU, the process's peak RSS), each against the paper
model. It checks the model at that size: the parameter count equals the paper's count, and the loss is finite.
`--precision highest` runs the steps and the peak's matmul at that float32 precision (`model.matmul_precision`).
The last line is `mfu=<value>`. `--json FILE` appends each measurement as a JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Shape:
    """A decoder's shape: what the paper model needs, and what builds it in Levanter."""

    family: str  # "qwen" (qkv bias) or "llama"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    tied: bool
    head_dim: int | None = None

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def linear_params(self) -> int:
        """Parameters that enter a matmul per token: the attention projections (with Qwen's q/k/v biases), the MLP
        and the LM head (the output projection, also when it shares the embedding's matrix)."""
        q, kv = self.heads * self.d, self.kv_heads * self.d
        attn = self.hidden * q + 2 * self.hidden * kv + q * self.hidden
        if self.family == "qwen":
            attn += q + 2 * kv
        return self.layers * (attn + 3 * self.hidden * self.mlp) + self.vocab * self.hidden

    def params(self) -> int:
        """Every trainable parameter: the linear layers, the input embedding (unless tied to the head) and the RMS
        norms' scales."""
        norms = self.layers * 2 * self.hidden + self.hidden
        return self.linear_params() + (0 if self.tied else self.vocab * self.hidden) + norms

    def train_flops_per_token(self, seq: int) -> float:
        return 6 * self.linear_params() + 12 * self.layers * seq * self.heads * self.d

    def activation_floats_per_token(self, checkpointing: bool) -> float:
        q, kv = self.heads * self.d, self.kv_heads * self.d
        layer = 4 * self.hidden + 2 * q + 2 * kv + 4 * self.mlp
        body = self.layers * self.hidden + layer if checkpointing else self.layers * layer
        return body + 5 * self.vocab

    def lora_params(self, rank: int) -> int:
        """LoRA adapters of `rank` on every linear layer of every block: rank × (inputs + outputs) each."""
        q, kv = self.heads * self.d, self.kv_heads * self.d
        sides = (self.hidden + q) * 2 + (self.hidden + kv) * 2 + (self.hidden + self.mlp) * 3
        return self.layers * rank * sides

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.d * dtype_bytes

    def levanter_config(self, seq: int):
        """The Levanter config of this shape (random initialisation builds it)."""
        from levanter.layers.rotary import DefaultRotaryEmbeddingsConfig
        from levanter.models.llama import LlamaConfig
        from levanter.models.qwen import QwenConfig

        cls = QwenConfig if self.family == "qwen" else LlamaConfig
        return cls(
            max_seq_len=seq,
            hidden_dim=self.hidden,
            intermediate_dim=self.mlp,
            num_layers=self.layers,
            num_heads=self.heads,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            tie_word_embeddings=self.tied,
            layer_norm_epsilon=1e-6,
            rope=DefaultRotaryEmbeddingsConfig(theta=1e6 if self.family == "qwen" else 5e5),
            scan_layers=True,
        )


PRESETS: dict[str, Shape] = {
    "qwen-100m": Shape("qwen", 768, 12, 12, 2, 2048, 32768, tied=True),
    "qwen2.5-0.5b": Shape("qwen", 896, 24, 14, 2, 4864, 151936, tied=True),
    "qwen2.5-1.5b": Shape("qwen", 1536, 28, 12, 2, 8960, 151936, tied=True),
    "qwen2.5-7b": Shape("qwen", 3584, 28, 28, 4, 18944, 152064, tied=False),
    "llama3-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128256, tied=False),
    "smoke": Shape("qwen", 64, 2, 4, 2, 128, 256, tied=True),
}
"""Qwen2.5's and Llama 3's published config.json shapes, a ~100M Qwen-shaped model, and a tiny one for --smoke."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a step trains and what the engine holds: packed rows × row length, microbatches, rematerialisation."""

    rows: int = 16
    seq: int = 1024
    microbatches: int = 1
    checkpointing: bool = False
    max_seqs: int = 256
    kv_dtype_bytes: int = 4
    lora_rank: int = 0  # > 0: LoRA adapters of this rank on every linear layer; the base is frozen


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    chips: int
    memory_per_chip: float  # bytes
    f32_peak: float  # FLOP/s for the whole device group at the learner's float32 (default precision)
    bandwidth: float  # bytes/s, whole group


DEVICES = [
    Device("H100 80GB", 1, 80e9, 370e12, 3.0e12),
    Device("TPU v5e-8", 8, 16 * GIB, 8 * 197e12, 8 * 819e9),
]


def paper(shape: Shape, work: Workload) -> dict[str, float]:
    """Memory (bytes) of the learner's state, activations and the KV cache for `work` on `shape`."""
    n = shape.params()
    trained = shape.lora_params(work.lora_rank) if work.lora_rank else n
    tokens = work.rows * work.seq // work.microbatches
    return {
        "params": n,
        "weights": 4 * (n + trained * (work.lora_rank > 0)),
        "grads": 4 * trained,
        "adam": 8 * trained,
        "activations": 4 * tokens * shape.activation_floats_per_token(work.checkpointing),
        "kv_cache": shape.kv_bytes_per_token(work.kv_dtype_bytes) * work.max_seqs * work.seq,
    }


def paper_table(mfu: float, work: Workload) -> list[str]:
    """The README's table: every preset on every paper device, full fine-tuning, and LoRA (rank 16, 64 sequences
    in the engine) for the presets whose full fine-tuning does not fit."""
    lines = [
        f"| model | training | params | weights + grads + Adam | activations | KV cache (f32) | device "
        f"| memory per chip | fits | train tok/s at MFU {mfu:.2f} | decode tok/s (half-full cache) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lora = dataclasses.replace(work, lora_rank=16, max_seqs=64)
    for name, shape in PRESETS.items():
        if name == "smoke":
            continue
        full_fits = True
        for w in (work, lora):
            if w is lora and full_fits:
                continue  # LoRA rows only where full fine-tuning does not fit somewhere
            p = paper(shape, w)
            state = p["weights"] + p["grads"] + p["adam"]
            rows = _per_chip(p)
            full_fits = all(fits for _, _, fits in rows)
            for dev, per_chip, fits in rows:
                flops = shape.train_flops_per_token(w.seq)
                train = mfu * dev.f32_peak / (flops if w is work else flops * 2 / 3)  # LoRA: no weight gradients
                cache_per_seq = shape.kv_bytes_per_token(w.kv_dtype_bytes) * w.seq / 2
                step = max(
                    (4 * shape.params() + w.max_seqs * cache_per_seq) / dev.bandwidth,
                    2 * shape.params() * w.max_seqs / dev.f32_peak,
                )
                label = "full" if w is work else f"LoRA r{w.lora_rank}"
                lines.append(
                    f"| {name} | {label} | {shape.params() / 1e9:.2f}B | {state / 1e9:.1f} GB "
                    f"| {p['activations'] / 1e9:.1f} GB | {p['kv_cache'] / 1e9:.1f} GB ({w.max_seqs} × {w.seq}) "
                    f"| {dev.name} | {per_chip / 1e9:.1f} GB | {'yes' if fits else 'no'} | {train:,.0f} "
                    f"| {w.max_seqs / step:,.0f} |"
                )
    return lines


def _per_chip(p: dict[str, float]) -> list[tuple[Device, float, bool]]:
    """(device, bytes per chip, whether that fits in 90% of a chip) for the paper memory `p` on every device."""
    total = p["weights"] + p["grads"] + p["adam"] + p["activations"] + p["kv_cache"]
    return [(dev, total / dev.chips, total / dev.chips < 0.9 * dev.memory_per_chip) for dev in DEVICES]


# ---- measurement (the worker subprocess) ---------------------------------------------------------------------------


def packed_batch(rng, rows: int, seq: int, vocab: int):
    """`rows` packed rows of `seq` tokens, four rollouts each, with random advantages (what the learner trains)."""
    from marin_rl.types import PackedBatch

    segs = np.zeros((rows, seq), np.int32)
    pos = np.zeros((rows, seq), np.int32)
    for r in range(rows):
        margin = seq // 16
        cuts = [0, *sorted(rng.choice(np.arange(margin, seq - margin), 3, replace=False)), seq]
        for s in range(4):
            segs[r, cuts[s] : cuts[s + 1]] = s
            pos[r, cuts[s] : cuts[s + 1]] = np.arange(cuts[s + 1] - cuts[s])
    mask = pos >= seq // 32
    return PackedBatch(
        input_ids=rng.integers(0, vocab, (rows, seq)).astype(np.int32),
        position_ids=pos,
        segment_ids=segs,
        loss_mask=mask,
        advantages=np.where(mask, rng.normal(size=(rows, seq)), 0).astype(np.float32),
        sampler_logprobs=np.where(mask, -np.log(vocab), 0).astype(np.float32),
        token_versions=np.where(mask, 0, -1).astype(np.int32),
    )


def device_peak_bytes() -> tuple[float | None, float]:
    """(the device's peak bytes in use, or None where it reports none; the process's peak RSS in bytes)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    return stats.get("peak_bytes_in_use"), rss


def measure(name: str, work: Workload, steps: int) -> dict:
    import jax
    from device_local import matmul_peak

    from marin_rl.learner.config import LearnerConfig
    from marin_rl.learner.learner import Learner
    from marin_rl.model.config import ModelConfig

    shape = PRESETS[name]
    platform = jax.devices()[0].platform
    t0 = time.perf_counter()
    model_config = ModelConfig(architecture=shape.levanter_config(work.seq), gradient_checkpointing=work.checkpointing)
    learner = Learner(model_config, LearnerConfig(microbatches=work.microbatches), shape.vocab)
    built_s = time.perf_counter() - t0
    if learner.num_params != shape.params():
        raise SystemExit(f"{name}: Levanter built {learner.num_params:,} parameters; the paper: {shape.params():,}")
    rng = np.random.default_rng(0)
    batches = [packed_batch(rng, work.rows, work.seq, shape.vocab) for _ in range(2)]
    t = time.perf_counter()
    first = learner.train_step(batches[0])
    compile_s = time.perf_counter() - t
    times, losses = [], [first.get("learner/loss")]
    for i in range(steps):
        t = time.perf_counter()
        metrics = learner.train_step(batches[1 + i % 1])
        jax.block_until_ready(learner.model)
        times.append(time.perf_counter() - t)
        losses.append(metrics.get("learner/loss"))
    if not all(np.isfinite(x) for x in losses if x is not None):
        raise SystemExit(f"{name}: the loss is not finite: {losses}")
    peak_bytes, rss = device_peak_bytes()
    dot_n = 8192 if platform in ("gpu", "tpu") else 2048
    f32_peak = matmul_peak(dot_n, "float32")
    bf16_peak = matmul_peak(dot_n, "bfloat16")
    step = float(np.median(times))
    tokens = work.rows * work.seq
    achieved = shape.train_flops_per_token(work.seq) * tokens / step
    return {
        "preset": name,
        "device": str(jax.devices()[0].device_kind),
        "platform": platform,
        "jax": jax.__version__,
        "matmul_precision": jax.config.jax_default_matmul_precision,
        "params": learner.num_params,
        "workload": dataclasses.asdict(work),
        "build_s": built_s,
        "compile_and_first_step_s": compile_s,
        "step_s": times,
        "step_median_s": step,
        "trained_tokens_per_s": tokens / step,
        "achieved_flops": achieved,
        "f32_peak": f32_peak,
        "bf16_peak": bf16_peak,
        "mfu": achieved / f32_peak,
        "mfu_bf16_peak": achieved / bf16_peak,
        "losses": losses,
        "device_peak_bytes": peak_bytes,
        "peak_rss_bytes": rss,
        "paper": paper(shape, work),
    }


def report(r: dict) -> None:
    p = paper(PRESETS[r["preset"]], Workload(**r["workload"]))  # today's paper model, also for recorded runs
    state = p["weights"] + p["grads"] + p["adam"]
    w = r["workload"]
    tokens = w["rows"] * w["seq"]
    achieved = PRESETS[r["preset"]].train_flops_per_token(w["seq"]) * tokens / r["step_median_s"]
    print(
        f"{r['preset']} on {r['device']} (jax {r['jax']}): {r['params']:,} parameters (= the paper's count); "
        f"{w['rows']}×{w['seq']} tokens a step, {w['microbatches']} microbatch(es), checkpointing "
        f"{w['checkpointing']}; build {r['build_s']:.1f} s, compile + first step {r['compile_and_first_step_s']:.1f} s"
    )
    print(
        f"  step {r['step_median_s'] * 1e3:.0f} ms (median of {len(r['step_s'])}); {r['trained_tokens_per_s']:,.0f} "
        f"trained tok/s; {achieved / 1e12:.2f} TFLOP/s achieved; matmul peak f32 {r['f32_peak'] / 1e12:.1f}, bf16 "
        f"{r['bf16_peak'] / 1e12:.1f} TFLOP/s; MFU {achieved / r['f32_peak']:.3f} (against bf16: "
        f"{achieved / r['bf16_peak']:.3f}); losses {', '.join(f'{x:.3f}' for x in r['losses'])}"
    )
    on_paper = state + p["activations"]
    measured = r["device_peak_bytes"]
    label = "device peak in use"
    if measured is None:
        measured, label = r["peak_rss_bytes"], "process peak RSS"
    print(
        f"  memory: {label} {measured / GIB:.2f} GiB; paper {on_paper / GIB:.2f} GiB (state {state / GIB:.2f} + "
        f"activations {p['activations'] / GIB:.2f}); measured / paper {measured / on_paper:.2f}"
    )


def _worker(args) -> None:
    if args.precision:
        import jax

        jax.config.update("jax_default_matmul_precision", args.precision)
    work = Workload(args.rows, args.seq, args.microbatches, args.checkpointing)
    print("RESULT " + json.dumps(measure(args.measure[0], work, args.steps)), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", nargs="*", default=None, metavar="PRESET", help=f"of {sorted(PRESETS)}")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the compiling one")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (true)")
    parser.add_argument(
        "--precision", default=None, help="JAX's float32 matmul precision for the steps (model.matmul_precision)"
    )
    parser.add_argument("--mfu", type=float, default=0.3, help="the MFU the paper table assumes")
    parser.add_argument("--json", default=None, help="append each measurement here as a JSON line")
    parser.add_argument("--report", default=None, help="print the measurements recorded in this JSON-lines file")
    parser.add_argument("--smoke", action="store_true", help="a tiny preset, one step (seconds)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.measure, args.steps, args.rows, args.seq = ["smoke"], 1, 4, 64
    if args.worker:
        _worker(args)
        return
    if args.report:
        with open(args.report) as f:
            for line in f:
                report(json.loads(line))
        return
    if args.measure is None:
        print("\n".join(paper_table(args.mfu, Workload(checkpointing=True, microbatches=4))))
        return
    unknown = [m for m in args.measure if m not in PRESETS]
    if unknown:
        raise SystemExit(f"--measure: unknown preset(s) {unknown}; presets: {sorted(PRESETS)}")
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # a GPU's JAX takes 75% by default
    results = []
    for name in args.measure:
        cmd = [sys.executable, __file__, "--worker", "--measure", name, "--steps", str(args.steps)]
        cmd += ["--rows", str(args.rows), "--seq", str(args.seq), "--microbatches", str(args.microbatches)]
        cmd += ["--checkpointing"] * args.checkpointing + (["--precision", args.precision] if args.precision else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"{name}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}")
            continue
        r = json.loads(lines[-1][len("RESULT ") :])
        results.append(r)
        report(r)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")
    if not results:
        raise SystemExit("no preset was measured")
    print(f"mfu={results[-1]['mfu']:.4f}")


if __name__ == "__main__":
    main()
