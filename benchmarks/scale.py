"""End-to-end local-backend RL at Qwen2.5-0.5B and 1.5B shapes: generated and trained tokens per second, the learner's
MFU against the bfloat16 peak measured in the same run, the step broken down, and device memory.

    python benchmarks/scale.py [--shape qwen2.5-0.5b|qwen2.5-1.5b] [--steps N] [--memory-gib G] [-- OVERRIDES...]
    python benchmarks/scale.py --paper     # the figures on paper for one H100, both shapes (no run)
    python benchmarks/scale.py --smoke     # a tiny shape on the CPU, a few steps (the test suite runs it)

The run is `python -m marin_rl.run` on a config this file writes (`orchestrator.backend: local`: the learner, the
embedded engine sampling from the learner's own arrays and the environment's workers in one process), launched as a
subprocess that owns the device, as `benchmarks/device_local.py` launches its run; after it exits, this process times
the device's matmul peak (float32 and bfloat16) and prints the figures.

`marin_rl` must be importable (installed, or `PYTHONPATH=<checkout>`): the run imports the environment below as
`benchmarks.scale:ScaleEnvironment` from the checkout's root, its working directory.

The workload: the model has the preset's published shape (`benchmarks/model_size.py`), randomly initialised, and
computes in `model.compute_dtype: auto` (bfloat16 on a GPU or TPU, float32 on a CPU); the engine is `--engine` (default
'dense', marin_rl's continuously batched engine; 'paged', Levanter's). It is built as a Levanter Llama of
that shape (rope theta 1e6 as Qwen's), not Levanter's Qwen2 class: the paged engine decodes Llama but not that class,
and Qwen2.5's only difference, the q/k/v biases, is 0.006% of the parameters (494.0M against 494.0M + 28k). There is no
model hub here, so the tokenizer is the character tokenizer padded to the preset's vocabulary
(`tokenizer.vocab_multiple` = 151,936 for Qwen2.5): the model's embedding and LM head have Qwen's exact sizes, and every
sampled id decodes (ids past the characters decode to `<unusedN>`). The environment, `ScaleEnvironment` below, is
synthetic: prompts of 150 random characters, one token each; each group of 8 gets a completion length drawn from a
GSM8K-like distribution, log-normal with median 250 tokens and σ 0.4, clipped to [128, 512]. A randomly initialised
model almost never samples EOS, so the environment asks for exactly that many tokens (`max_tokens` per request). Its
reward (the fraction of digits in the completion's text) is cheap and deterministic and varies within a group, so
advantages are not zero; the benchmark measures speed, not learning. Packed rows are `--seq` tokens long (4096; 2k-8k is
the range of interest) and a batch is `--rows` of them (8).

Gradient checkpointing and microbatches are chosen from a memory budget (`--memory-gib`; default: the device's memory as
JAX reports it, `bytes_limit`, or 8 GiB on a CPU), with `model_size.paper`'s memory model (float32 parameters, gradients
and AdamW; float32 activations, which overstates bfloat16 compute's, so the choice errs on the safe side; the engine's
KV cache for `--max-seqs` sequences of a prompt and the longest completion; on a GPU the engine's bfloat16 copy of the
weights). The rule (`plan`): the budget's 90% must hold the state, the KV cache and one microbatch's activations; take
the first that fits of, in order, (1) no checkpointing with 1, 2, 4, ... microbatches as long as a microbatch keeps at
least `--min-microbatch-tokens` (4096) tokens (smaller ones starve the matmuls), then (2) checkpointing with 1, 2, 4,
... microbatches down to one row each; the microbatch count must divide the rows. Recomputation costs a third more
learner FLOPs, so it comes only when microbatching alone would not fit; nothing fitting is refused in one line.

Printed: the run's parts as `benchmarks/colocated.py` prints them (start-up, steps 1 -> N, per step: learner step,
generation inside the engine's calls, hand-over, the driver's host work); tokens per second, generated and trained, end
to end (over the wall time of steps 2 -> N, after the first step's compilation) and per learner step (the learner's
tokens over its step time, median), where trained tokens are the real tokens of the packed rows (prompt and completion,
which the learner runs forward and backward; the sampled ones, under the loss, are printed beside); the step broken down
over steps 2 -> N (medians: learner, generation, hand-over, host, wall); learner MFU: trained tok/s (per learner step) ×
training FLOPs per token (`Shape.train_flops_per_token`: 6·N_linear + attention over the whole row, PaLM's count;
checkpointing's recomputation not counted) over the bfloat16 peak and over the float32 peak; device memory per phase (as
`device_local.memory_by_phase` reads the run's metrics). The two last lines are the issue's acceptance figures as
ratios: `learner_mfu_bf16_over_target=` (MFU against the bf16 peak over 0.30, the 1.5B target) and, last,
`trained_tok_s_over_target=` (end-to-end trained tok/s over 12,000, the 0.5B target).

On paper (`--paper`, computed by `paper_figures` from `model_size`'s model for one H100 80GB, for the default workload;
bf16 peak 989 TFLOP/s dense from the datasheet, 3.0 TB/s measured copy bandwidth, MFU 0.30 assumed): its figures are not
measurements. With the defaults (8 rows × 4096 tokens, 256 sequences in the engine) it printed on 2026-11-28: 0.5B, no
checkpointing, 4 microbatches, 55.7 GB, 73.8k trained tok/s for the learner alone, decode 367k tok/s, 65k trained tok/s
end to end; 1.5B, no checkpointing, 8 microbatches, 66.3 GB, 26.1k learner tok/s, decode 135k tok/s, 23k end to end. The
paper model's decode ignores per-step overheads and the learner's figure is the assumed MFU, so the end-to-end target
(12k at 0.5B) is the one to measure."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import statistics
import string
import sys
import tempfile
from dataclasses import dataclass

from marin_rl.bounds import bounded
from marin_rl.envs.base import Problem, SamplingParams, SingleTurnEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GIB = 1024**3
TRAINED_TOK_S_TARGET = 12_000.0
"""Issue 53's target at 0.5B: trained tokens per second end to end, one GPU."""
MFU_BF16_TARGET = 0.30
"""Issue 53's target at 1.5B: learner MFU against the bf16 peak."""
H100_BF16_PEAK = 989e12
"""One H100 SXM's dense bfloat16 matmul peak, from NVIDIA's datasheet (for `--paper` only; a run measures its own)."""
CPU_MEMORY_GIB = 8.0
"""The memory budget on a CPU, which reports none."""


def completion_length(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """One GSM8K-like completion length: log-normal with this median and σ (of the logarithm), clipped to [lo, hi]."""
    return min(max(round(math.exp(rng.gauss(math.log(median), sigma))), lo), hi)


class ScaleEnvironment(SingleTurnEnvironment):
    """Synthetic prompts of `prompt_tokens` random characters; each problem carries a completion length drawn from
    a GSM8K-like log-normal (median `median_tokens`, σ `sigma`, clipped to [`min_tokens`, `max_tokens`]), and every
    request of its group asks for exactly that many tokens (capped by the env's `sampling.max_tokens`). Reward
    'correct': the fraction of digit characters in the completion's text (cheap, deterministic; speed, not learning).
    With the character tokenizer one character is one token."""

    name = "scale"
    reward_weights = {"correct": 1.0}

    @dataclass
    class Args(SingleTurnEnvironment.Args):
        prompt_tokens: int = bounded(150, ge=1)
        """Characters (tokens, with the character tokenizer) per prompt."""
        median_tokens: float = bounded(250.0, gt=0)
        """Median of the completion lengths' log-normal."""
        sigma: float = bounded(0.4, ge=0)
        """σ of the completion lengths' log-normal (of their logarithm)."""
        min_tokens: int = bounded(128, ge=1)
        """Shortest completion asked for."""
        max_tokens: int = bounded(512, ge=1)
        """Longest completion asked for."""
        num_problems: int = bounded(4096, ge=1)
        """Training problems (each with its own prompt and length)."""
        num_eval: int = bounded(8, ge=1)
        """Held-out problems."""

        def __post_init__(self):
            super().__post_init__()
            if self.min_tokens > self.max_tokens:
                raise ValueError(f"min_tokens: must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")

    args: Args

    def __init__(self, tokenizer, **args):
        super().__init__(tokenizer, **args)
        rng = random.Random(self.seed)
        letters = string.ascii_letters + string.digits + " "
        problems = []
        for i in range(self.args.num_problems + self.args.num_eval):
            prompt = "".join(rng.choice(letters) for _ in range(self.args.prompt_tokens))
            problems.append(Problem(id=str(i), prompt=prompt, answer="", fields={"length": self.draw_length(rng)}))
        self._train, self._eval = problems[: self.args.num_problems], problems[self.args.num_problems :]

    def draw_length(self, rng: random.Random) -> int:
        """One completion length of this environment's distribution (`completion_length`)."""
        a = self.args
        return completion_length(rng, a.median_tokens, a.sigma, a.min_tokens, a.max_tokens)

    def train_problems(self) -> list[Problem]:
        """The training problems."""
        return self._train

    def eval_problems(self) -> list[Problem]:
        """The held-out problems."""
        return self._eval

    def _sampling(self, problem: Problem, sampling: SamplingParams) -> SamplingParams:
        return dataclasses.replace(sampling, max_tokens=min(problem.fields["length"], sampling.max_tokens))

    async def run_episode(self, policy, problem: Problem, sampling: SamplingParams):
        """One completion of the problem's drawn length."""
        return await super().run_episode(policy, problem, self._sampling(problem, sampling))

    async def run_group(self, policy, problem: Problem, group_size: int, sampling: SamplingParams):
        """`group_size` completions of the problem's drawn length, in one request."""
        return await super().run_group(policy, problem, group_size, self._sampling(problem, sampling))

    def score(self, problem: Problem, completion: str) -> dict[str, float]:
        """'correct': the fraction of the completion's characters that are digits."""
        return {"correct": sum(c.isdigit() for c in completion) / max(len(completion), 1)}


# ---- sizing ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What a step generates and trains."""

    rows: int = 8
    seq: int = 4096
    prompt_tokens: int = 150
    min_tokens: int = 128
    median_tokens: float = 250.0
    max_tokens: int = 512
    group_size: int = 8
    max_seqs: int = 256
    kv_dtype_bytes: int = 2  # bfloat16 cache on a GPU (float32 on a CPU)
    served_dtype_bytes: int = 2  # the engine's copy of the weights in the compute dtype (0: it serves the learner's)

    @property
    def engine_seq(self) -> int:
        """The engine's context: a prompt and the longest completion, rounded up to 64 tokens (a page)."""
        return -(-(self.prompt_tokens + self.max_tokens + 8) // 64) * 64


def plan(shape, work: Workload, budget_bytes: float, min_microbatch_tokens: int = 4096) -> tuple[bool, int, dict]:
    """(gradient checkpointing, microbatches, the paper memory of that choice) for `work` on `shape` within
    `budget_bytes`, by the rule in the module's docstring. Raises SystemExit when nothing fits."""
    import model_size

    counts = [m for m in (2**k for k in range(20)) if m <= work.rows and work.rows % m == 0]
    options = [(False, m) for m in counts if work.rows * work.seq // m >= min_microbatch_tokens]
    options += [(True, m) for m in counts]
    for checkpointing, m in options:
        p = model_size.paper(
            shape,
            model_size.Workload(
                rows=work.rows,
                seq=work.seq,
                microbatches=m,
                checkpointing=checkpointing,
                max_seqs=work.max_seqs,
                kv_dtype_bytes=work.kv_dtype_bytes,
            ),
        )
        # the KV cache spans the engine's context, not a packed row
        p["kv_cache"] = shape.kv_bytes_per_token(work.kv_dtype_bytes) * work.max_seqs * work.engine_seq
        p["served"] = work.served_dtype_bytes * shape.params()
        total = p["weights"] + p["grads"] + p["adam"] + p["activations"] + p["kv_cache"] + p["served"]
        if total <= 0.9 * budget_bytes:
            return checkpointing, m, {**p, "total": total}
    raise SystemExit(
        f"nothing fits in {budget_bytes / GIB:.1f} GiB: {work.rows} rows of {work.seq} tokens with checkpointing and "
        f"one row per microbatch still need more; lower --seq, --max-seqs or raise --memory-gib"
    )


def paper_figures(shape_name: str, work: Workload, mfu: float = MFU_BF16_TARGET) -> dict[str, float]:
    """One H100 80GB on paper (`model_size`'s model): the plan's memory, trained tok/s at `mfu` of the bf16 peak,
    and decode tok/s bound by bandwidth (each step reads the bf16 weights and the batch's KV cache at half the
    engine's context), capped by 2·N FLOPs per token at the bf16 peak."""
    import model_size

    shape = model_size.PRESETS[shape_name]
    h100 = model_size.DEVICES[0]
    checkpointing, m, p = plan(shape, work, h100.memory_per_chip)
    flops = shape.train_flops_per_token(work.seq)
    train = mfu * H100_BF16_PEAK / flops
    cache_per_seq = shape.kv_bytes_per_token(work.kv_dtype_bytes) * work.engine_seq / 2
    step = max(
        (2 * shape.params() + work.max_seqs * cache_per_seq) / h100.bandwidth,
        2 * shape.params() * work.max_seqs / H100_BF16_PEAK,
    )
    lengths = mean_completion_tokens(work)
    sampled = lengths / (lengths + work.prompt_tokens)  # of a row's trained tokens, those the engine generated
    return {
        "params": shape.params(),
        "checkpointing": checkpointing,
        "microbatches": m,
        "state_gb": (p["weights"] + p["grads"] + p["adam"]) / 1e9,
        "activations_gb": p["activations"] / 1e9,
        "kv_cache_gb": p["kv_cache"] / 1e9,
        "served_gb": p["served"] / 1e9,
        "total_gb": p["total"] / 1e9,
        "train_flops_per_token": flops,
        "trained_tok_s": train,
        "decode_tok_s": work.max_seqs / step,
        "mean_completion_tokens": lengths,
        # one device does both in turn: per trained token, its training and its share of decoding
        "end_to_end_trained_tok_s": 1.0 / (1.0 / train + sampled / (work.max_seqs / step)),
    }


def mean_completion_tokens(work: Workload, draws: int = 100_000) -> float:
    """The mean completion length of `ScaleEnvironment`'s distribution for `work` (`draws` seeded draws)."""
    rng = random.Random(0)
    sigma = ScaleEnvironment.Args.sigma  # the environment's default, which the run keeps
    return statistics.fmean(
        completion_length(rng, work.median_tokens, sigma, work.min_tokens, work.max_tokens) for _ in range(draws)
    )


def print_paper(work: Workload) -> None:
    """The `--paper` table: both Qwen2.5 shapes on one H100."""
    print(
        f"on paper, one H100 80GB (bf16 peak {H100_BF16_PEAK / 1e12:.0f} TFLOP/s datasheet, 3.0 TB/s), "
        f"{work.rows} rows × {work.seq} tokens a step, {work.max_seqs} sequences × {work.engine_seq} in the engine "
        f"(bf16 KV cache), MFU {MFU_BF16_TARGET:.2f} of bf16 assumed:"
    )
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
        f = paper_figures(name, work)
        print(
            f"  {name}: {f['params'] / 1e9:.2f}B params; checkpointing {f['checkpointing']}, {f['microbatches']} "
            f"microbatch(es); memory {f['total_gb']:.1f} GB (state {f['state_gb']:.1f} + activations "
            f"{f['activations_gb']:.1f} + KV cache {f['kv_cache_gb']:.1f} + served bf16 weights {f['served_gb']:.1f}); "
            f"{f['train_flops_per_token'] / 1e9:.2f} "
            f"GFLOP per trained token -> {f['trained_tok_s']:,.0f} trained tok/s; decode {f['decode_tok_s']:,.0f} "
            f"tok/s (bandwidth bound); completions {f['mean_completion_tokens']:.0f} tokens on average -> end to end "
            f"{f['end_to_end_trained_tok_s']:,.0f} trained tok/s (training and decoding in turn)"
        )


# ---- the run's config --------------------------------------------------------------------------------------------


def run_config(
    shape, work: Workload, checkpointing: bool, microbatches: int, steps: int, cpu: bool, engine: str = "dense"
) -> dict:
    """The run's config (a YAML-able dict): the preset's shape at random initialisation, the synthetic environment,
    rows of `work.seq` tokens, and the planned checkpointing and microbatches."""
    arch = shape.levanter_config(work.seq)
    theta = 1e6 if shape.vocab == 151936 or shape.family == "qwen" else arch.rope.theta
    return {
        "model": {
            "seed": 0,
            "architecture": {
                "type": shape.family,
                "max_seq_len": max(work.seq, work.engine_seq),
                "hidden_dim": arch.hidden_dim,
                "intermediate_dim": arch.intermediate_dim,
                "num_layers": arch.num_layers,
                "num_heads": arch.num_heads,
                "num_kv_heads": arch.num_kv_heads,
                "tie_word_embeddings": arch.tie_word_embeddings,
                "layer_norm_epsilon": arch.layer_norm_epsilon,
                "rope": {"type": "default", "theta": theta},
                "scan_layers": True,
            },
            "gradient_checkpointing": checkpointing,
            "compute_dtype": "auto",
        },
        # the character tokenizer padded to the preset's vocabulary: Qwen's embedding and head sizes, no hub
        "tokenizer": {"path": None, "kind": "char", "vocab_multiple": shape.vocab},
        "envs": [
            {
                "name": "scale",
                "env_class": "benchmarks.scale:ScaleEnvironment",
                "args": {
                    "prompt_tokens": work.prompt_tokens,
                    "median_tokens": work.median_tokens,
                    "min_tokens": work.min_tokens,
                    "max_tokens": work.max_tokens,
                    "num_eval": 8,
                },
                "replicas": 1,
                "concurrency": max(work.max_seqs // work.group_size, 1),
                "group_size": work.group_size,
                "sampling": {"temperature": 1.0, "max_tokens": work.max_tokens},
                "eval_samples_per_problem": 1,
            }
        ],
        "inference": {
            "num_servers": 1,
            "max_seqs": work.max_seqs,
            "max_seq_len": max(work.seq, work.engine_seq),  # a run refuses rows longer than the engine's context
            "levanter": {
                # dense: marin_rl's continuously batched engine (its cache spans prompt + longest completion,
                # rounded up to a power of two); paged: Levanter's
                "engine": engine,
                "kv_cache_dtype": "float32" if cpu else "bfloat16",
                # pages for every sequence's prompt and longest completion, not for a whole row each
                "page_size": 64,
                "max_pages": work.max_seqs * work.engine_seq // 64,
            },
        },
        "replay": {"min_group_size": 2, "max_age": 2},
        "batcher": {"total_token_budget": work.rows * work.seq, "max_seq_len": work.seq},
        "learner": {
            "algorithm": "rloo",
            "microbatches": microbatches,
            "optimizer": {"learning_rate": 1.0e-6, "max_grad_norm": 1.0},
            "loss": {"objective": "decoupled", "clip_low": 0.2, "clip_high": 0.28, "aggregation": "token_mean"},
            "warm_start": {"steps": 0},
        },
        "broadcast": {"sync_every": 1},
        "orchestrator": {"backend": "local", "num_steps": steps, "max_staleness": 1, "eval_every": 0, "seed": 0},
        "tracking": {"wandb_mode": "disabled"},
        "checkpoint": {"every": 0},
    }


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def end_to_end_rate(rows: list[dict], key: str, per_window: bool = False) -> float:
    """Tokens per second over the wall time of steps 2 -> N (after the first step's compilation): the per-step count
    `key` of steps 2..N over the `time/unix` between step 1's row and step N's. With `per_window`, `key` is a rate
    over the window since the previous row (`throughput/generated_tokens_per_s`), weighted by that window."""
    stepped = sorted((r for r in rows if r.get("step", 0) >= 1 and "time/unix" in r), key=lambda r: r["step"])
    if len(stepped) < 2:
        return 0.0
    tokens = 0.0
    for before, row in zip(stepped, stepped[1:], strict=False):
        value = row.get(key, 0.0)
        tokens += value * (row["time/unix"] - before["time/unix"]) if per_window else value
    return tokens / max(stepped[-1]["time/unix"] - stepped[0]["time/unix"], 1e-9)


END_OF_RUN_SECTIONS = ("wait", "eval", "export", "checkpoint")
"""Driver sections that are not host work of a steady step: waiting, and what this run does once at its end (the
held-out evaluation, the Hugging Face export, the checkpoint; `eval_every` and `checkpoint.every` are 0)."""


def _host_section(key: str) -> bool:
    return key.startswith("profile/driver/") and key.split("/")[-1].removesuffix("_s") not in END_OF_RUN_SECTIONS


def steady_step(rows: list[dict]) -> dict[str, float]:
    """The step broken down over steps 2 -> N (after the first step's compilation), medians in seconds: the learner's
    step, generation (the increase of the engine's cumulative seconds inside its calls), the hand-over (publish and
    apply), the driver's host work (its loop sections but `END_OF_RUN_SECTIONS`) and the wall time between rows.
    The parts need not sum to the wall: a row's sections and the window between two rows are not aligned exactly, and
    parts may overlap."""
    stepped = sorted((r for r in rows if r.get("step", 0) >= 1 and "time/unix" in r), key=lambda r: r["step"])
    pairs = list(zip(stepped, stepped[1:], strict=False))
    if not pairs:
        return {}

    def med(values: list[float]) -> float:
        return statistics.median(values) if values else 0.0

    return {
        "learner": med([r["learner/step_time_s"] for _, r in pairs if "learner/step_time_s" in r]),
        "generation": med(
            [
                r["servers/0/engine_s"] - b["servers/0/engine_s"]
                for b, r in pairs
                if "servers/0/engine_s" in r and "servers/0/engine_s" in b
            ]
        ),
        "hand-over": med([r.get("broadcast/seconds", 0.0) + r.get("broadcast/publish_s", 0.0) for _, r in pairs]),
        "host": med([sum(v for k, v in r.items() if _host_section(k)) for _, r in pairs]),
        "wall": med([r["time/unix"] - b["time/unix"] for b, r in pairs]),
    }


def main() -> None:
    """Plan, write the config, run it in a subprocess, then time the peaks and print the figures."""
    import model_size
    import yaml

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    parser.add_argument("--steps", type=int, default=None, help="learner steps (default 10; --smoke 3)")
    parser.add_argument("--rows", type=int, default=8, help="packed rows per batch")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per packed row (2k-8k)")
    parser.add_argument("--max-seqs", type=int, default=256, help="sequences the engine decodes together")
    parser.add_argument("--engine", default="dense", choices=["dense", "paged"], help="inference.levanter.engine")
    parser.add_argument("--memory-gib", type=float, default=None, help="memory budget (default: the device's)")
    parser.add_argument("--min-microbatch-tokens", type=int, default=4096, help="see the rule in the docstring")
    parser.add_argument("--output-dir", default=None, help="where the run writes (default: a temporary dir)")
    parser.add_argument("--paper", action="store_true", help="print the on-paper figures for one H100 and exit")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU, a few steps (seconds)")
    parser.add_argument("overrides", nargs="*", help="more `--key value` overrides for the run (after `--`)")
    args = parser.parse_args()
    if args.paper:
        print_paper(Workload(rows=args.rows, seq=args.seq, max_seqs=args.max_seqs))
        return

    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # a GPU's JAX takes 75% by default
    from colocated import describe, run
    from device_local import matmul_peak, memory_by_phase

    if args.smoke:
        name, steps = "smoke", args.steps or 3
        work = Workload(rows=2, seq=256, prompt_tokens=16, min_tokens=8, median_tokens=16, max_tokens=32)
        work = dataclasses.replace(work, max_seqs=16)
    else:
        name, steps = args.shape, args.steps or 10
        work = Workload(rows=args.rows, seq=args.seq, max_seqs=args.max_seqs)
    # Llama's code at the preset's shape: the paged engine decodes Llama, not Levanter's Qwen2 (whose only difference,
    # the q/k/v biases, is 0.03% of the parameters); rope theta stays Qwen's
    shape = dataclasses.replace(model_size.PRESETS[name], family="llama")
    platform, limit = _device_info()
    budget = args.memory_gib * GIB if args.memory_gib else float(limit) if limit else CPU_MEMORY_GIB * GIB
    cpu = args.smoke or platform == "cpu"
    if cpu:  # float32 compute: the engine serves the learner's own arrays, and caches in float32
        work = dataclasses.replace(work, kv_dtype_bytes=4, served_dtype_bytes=0)
    min_tokens = 1 if args.smoke else args.min_microbatch_tokens
    checkpointing, microbatches, p = plan(shape, work, budget, min_tokens)
    print(
        f"{name}: {shape.params() / 1e6:.1f}M parameters; {work.rows} rows × {work.seq} tokens a step; budget "
        f"{budget / GIB:.1f} GiB -> gradient checkpointing {checkpointing}, {microbatches} microbatch(es); paper "
        f"memory {p['total'] / GIB:.2f} GiB (state {(p['weights'] + p['grads'] + p['adam']) / GIB:.2f}, activations "
        f"{p['activations'] / GIB:.2f}, KV cache {p['kv_cache'] / GIB:.2f}, served copy {p['served'] / GIB:.2f})",
        flush=True,
    )
    out = args.output_dir or tempfile.mkdtemp(prefix="scale-bench-")
    run_dir = os.path.join(out, "run")
    if os.path.isdir(os.path.join(run_dir, "checkpoints")):
        raise SystemExit(f"--output-dir {out} holds a run ({run_dir}): it would resume, not run; give a new one")
    os.makedirs(out, exist_ok=True)
    config = os.path.join(out, f"scale_{name}.yaml")
    with open(config, "w") as f:
        yaml.safe_dump(
            run_config(shape, work, checkpointing, microbatches, steps, cpu, args.engine), f, sort_keys=False
        )
    launch, end, rows, summary = run(config, run_dir, list(args.overrides))
    describe(f"scale {name}", launch, end, rows, 2.0)  # no reward target: speed, not learning
    stepped = [r for r in rows if r.get("step", 0) >= 1 and "learner/step_time_s" in r]

    # Only now does this process touch the device (the run has exited and released it).
    import jax

    device = jax.devices()[0]
    n = 256 if args.smoke else 2048 if device.platform == "cpu" else 8192
    peak_f32, peak_bf16 = matmul_peak(n, "float32"), matmul_peak(n, "bfloat16")
    flops_per_token = shape.train_flops_per_token(work.seq)
    trained_step = _median(stepped, "learner/tokens_per_s") or 0.0
    generated_step = _median(stepped, "throughput/generated_tokens_per_s") or 0.0
    trained_e2e = end_to_end_rate(rows, "batches/tokens")
    sampled_e2e = end_to_end_rate(rows, "batches/trained_tokens")
    generated_e2e = end_to_end_rate(rows, "throughput/generated_tokens_per_s", per_window=True)
    achieved = trained_step * flops_per_token
    print(f"device: {device.platform} {device.device_kind} ×{jax.device_count()}, jax {jax.__version__}")
    print(
        f"whole run {summary.get('wall_time_s', 0):.1f} s: {summary.get('generated_tokens', 0):,} tokens generated, "
        f"{summary.get('trained_tokens', 0):,} trained; {flops_per_token / 1e9:.3f} GFLOP per trained token"
    )
    print(
        f"tokens per second, end to end (steps 2 -> {steps}): generated {generated_e2e:,.0f}, trained "
        f"{trained_e2e:,.0f} (of them sampled, under the loss: {sampled_e2e:,.0f}); per learner step (median): "
        f"generated {generated_step:,.0f}, trained {trained_step:,.0f}"
    )
    steady = steady_step(rows)
    print(f"step, steps 2 -> {steps} (medians, ms): " + ", ".join(f"{k} {v * 1000:.1f}" for k, v in steady.items()))
    print(
        f"learner MFU: {achieved / 1e12:.3f} TFLOP/s achieved; bf16 peak {peak_bf16 / 1e12:.1f} TFLOP/s ({n}×{n} "
        f"matmul) -> {achieved / peak_bf16:.4f}; f32 peak {peak_f32 / 1e12:.1f} TFLOP/s -> {achieved / peak_f32:.4f}"
    )
    memory = memory_by_phase(stepped)
    print(
        "device memory (MB; medians over steps, peaks as maxima): "
        + "; ".join(f"{k} {v:,.0f}" for k, v in memory.items())
    )
    print(f"learner_mfu_bf16_over_target={achieved / peak_bf16 / MFU_BF16_TARGET:.6f}")
    print(f"trained_tok_s_over_target={trained_e2e / TRAINED_TOK_S_TARGET:.6f}")
    sys.stdout.flush()


def _device_info() -> tuple[str, float | None]:
    """(platform, memory bytes) of the default device, asked in a subprocess so this process leaves it free."""
    import json
    import subprocess

    code = (
        "import jax, json; d = jax.devices()[0]; s = d.memory_stats() or {}; "
        "print(json.dumps([d.platform, s.get('bytes_limit')]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    platform, limit = json.loads(proc.stdout.strip().splitlines()[-1])
    return platform, limit


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.path.insert(0, ROOT)
    main()
