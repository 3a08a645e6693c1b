"""Inference benchmark: generated tokens/s through the HTTP client against calling Levanter's engine directly.

One embedded server (`LevanterInferenceServer`) holds a Llama (hidden 256, 4 layers, 8 heads, MLP 1024, the
character vocabulary; float32 KV cache). The workload is `--prompts` prompts of 8–24 tokens, each sampled `--n`
times, `--max-tokens` tokens per sample at temperature 1 with fixed seeds and no stop tokens, so every sample has
exactly `--max-tokens` tokens and both paths do the same work:

- engine: `InferenceEngine.generate` on the server's own engine (same compiled functions, weights and seeds),
  the requests cut into engine calls of at most `max_seqs` sequences, as the server cuts them;
- http:   `PolicyClient.sample(prompt, n=...)` for every prompt at once (asyncio), through the OpenAI-compatible
  HTTP API: JSON, token-id prompts, the server's batching and response building included.

Both paths must return the same tokens (checked). Each path runs once to compile and warm up, then `--repeats`
times; the median is reported. Also printed: the HTTP path with generation cut into segments of
`--segment-tokens` (partial rollouts: weights can change between segments), as information.

Embedded vs vLLM (the clearly marked `vllm_comparison`): the same requests through the same client to a vLLM server
of the same weights — `--vllm-address HOST:PORT`, or else `VllmPolicyServer` started on the model exported as a
Hugging Face checkpoint when the vLLM environment exists; otherwise skipped, and the reason printed.

The last line is `http_over_engine=<value>`. Run: `python benchmarks/inference.py`; `--smoke` runs a tiny workload
in seconds without vLLM (the test suite does, so the benchmark cannot break unnoticed).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import logging
import statistics
import tempfile
import time

import haliax as hax
import jax
import numpy as np
from levanter.inference.engine import Request
from levanter.inference.jit_scheduler import SeqDecodingParams
from levanter.models.llama import LlamaConfig

from marin_rl.inference.client import PolicyClient
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.model.build import parameter_count
from marin_rl.tokenizer import build_char_tokenizer


def bench_model(smoke: bool = False) -> LlamaConfig:
    """A small Llama whose decode step costs more than the host-side bookkeeping around it (smoke: a tiny one)."""
    if smoke:
        return LlamaConfig(
            max_seq_len=128,
            hidden_dim=32,
            intermediate_dim=64,
            num_layers=1,
            num_heads=2,
            num_kv_heads=2,
            gradient_checkpointing=False,
            scan_layers=True,
            tie_word_embeddings=False,
        )
    return LlamaConfig(
        max_seq_len=256,
        hidden_dim=256,
        intermediate_dim=1024,
        num_layers=4,
        num_heads=8,
        num_kv_heads=8,
        gradient_checkpointing=False,
        scan_layers=True,
        tie_word_embeddings=False,
    )


def make_prompts(num: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab - 10, int(rng.integers(8, 25))).tolist() for _ in range(num)]


def run_engine(server: LevanterInferenceServer, prompts, n: int, max_tokens: int, seed: int) -> list[list[int]]:
    """All samples through `InferenceEngine.generate`, in calls of at most `max_seqs` sequences."""
    ctx = server.context
    engine = ctx.engine
    seqs = [(p, seed + i * n + k) for i, p in enumerate(prompts) for k in range(n)]
    out: list[list[int]] = []
    step = engine.config.max_seqs
    trainer = ctx.config.trainer  # the mesh and axis mapping the server's engine calls run under
    with (
        ctx.model_lock,
        hax.partitioning.set_mesh(trainer.device_mesh),
        hax.axis_mapping(trainer.compute_axis_mapping),
    ):
        for start in range(0, len(seqs), step):
            requests = [
                Request(
                    prompt_tokens=p,
                    request_id=j,
                    decode_params=SeqDecodingParams(
                        max_num_tokens=np.int32(len(p) + max_tokens),
                        stop_tokens=None,
                        temperature=np.float32(1.0),
                        top_p=np.float32(1.0),
                        key=np.array([0, s], dtype=np.uint32),
                    ),
                    n_generations=1,
                )
                for j, (p, s) in enumerate(seqs[start : start + step])
            ]
            result = engine.generate(requests)
            out.extend(list(t) for t in result.tokens)
    return out


async def run_http(addresses: list[str], prompts, n: int, max_tokens: int, seed: int) -> list[list[int]]:
    """All samples through `PolicyClient`, one request (n samples) per prompt, all in flight at once."""
    client = PolicyClient(addresses, max_concurrent_requests=max(32, len(prompts)))
    try:
        groups = await asyncio.gather(
            *(
                client.sample(p, n=n, max_tokens=max_tokens, temperature=1.0, seed=seed + i * n)
                for i, p in enumerate(prompts)
            )
        )
    finally:
        await client.aclose()
    return [s.token_ids for g in groups for s in g]


def timed(fn, repeats: int) -> tuple[float, list[list[int]]]:
    """Median seconds of `repeats` calls after one warm-up call; and the warm-up's output."""
    out = fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def vllm_comparison(args, model, tok, config: InferenceConfig, prompts, embedded_tps: float) -> None:
    """==== Embedded vs vLLM ==== the same requests through the same client to a vLLM server of the same weights.

    `--vllm-address` names a running one; otherwise, when the vLLM environment exists (`marin_rl.inference.vllm_env`),
    the model is exported as a Hugging Face checkpoint and served by `VllmPolicyServer`. Skipped (reason printed)
    when neither is possible or `--no-vllm` is given.
    """
    if args.no_vllm:
        print("embedded vs vLLM: skipped (--no-vllm)")
        return
    server = None
    address = args.vllm_address
    if address is None:
        if importlib.util.find_spec("marin_rl.inference.vllm_server") is None:
            print("embedded vs vLLM: skipped (marin_rl/inference/vllm_server.py does not exist)")
            return
        from marin_rl.inference import vllm_env

        if not vllm_env.is_ready():
            print(f"embedded vs vLLM: skipped (no vLLM environment; create it with `{vllm_env.create_command()}`)")
            return
        from marin_rl.inference.vllm_server import VllmPolicyServer
        from marin_rl.model.hf import export_hf_checkpoint

        model_dir = args.export_hf or tempfile.mkdtemp(prefix="inference-bench-hf-")
        export_hf_checkpoint(model, tok, model_dir)
        try:
            server = VllmPolicyServer(model, model_dir, tok, dataclasses.replace(config, backend="vllm"))
            address = server.start()
        except Exception as e:  # a machine where vLLM cannot run (no accelerator, too little memory)
            print(f"embedded vs vLLM: skipped (vLLM failed to start: {type(e).__name__}: {str(e)[:300]})")
            if server is not None:
                server.stop()
            return
    try:
        seconds, tokens = timed(
            lambda: asyncio.run(run_http([address], prompts, args.n, args.max_tokens, args.seed)), args.repeats
        )
    finally:
        if server is not None:
            server.stop()
    tps = sum(len(t) for t in tokens) / seconds
    print(f"vLLM via http:        {tps:9.0f} tok/s ({seconds:.2f} s); embedded / vLLM = {embedded_tps / tps:.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (one request)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-seqs", type=int, default=128, help="inference.max_seqs of the server")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--segment-tokens", type=int, default=16, help="segment length of the informational run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-address", default=None, help="HOST:PORT of a vLLM server of the same weights")
    parser.add_argument("--export-hf", default=None, help="write the benchmark model here as an HF checkpoint")
    parser.add_argument("--no-vllm", action="store_true", help="skip the embedded vs vLLM comparison")
    parser.add_argument("--smoke", action="store_true", help="a tiny workload without vLLM (seconds): checks it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.n, args.max_tokens, args.max_seqs, args.repeats = 8, 2, 8, 16, 1
        args.segment_tokens, args.no_vllm = 4, True
    logging.basicConfig(level=logging.WARNING)
    for name in ("levanter", "httpx", "uvicorn"):
        logging.getLogger(name).setLevel(logging.ERROR)

    tok = build_char_tokenizer()
    model = bench_model(args.smoke).build(hax.Axis("vocab", len(tok)), key=jax.random.PRNGKey(0))
    config = InferenceConfig(
        max_seqs=args.max_seqs,
        max_seq_len=128,
        levanter=LevanterServerConfig(page_size=16, prefill_tokens=4096, segment_tokens=None),
    )
    server = LevanterInferenceServer(model, tok, config)
    address = server.start()
    prompts = make_prompts(args.prompts, len(tok), args.seed)
    total = args.prompts * args.n * args.max_tokens
    print(
        f"model: Llama {parameter_count(model) / 1e6:.2f}M parameters; {args.prompts} prompts × n={args.n} × "
        f"{args.max_tokens} tokens = {total} tokens per run; server max_seqs={args.max_seqs}"
    )
    try:
        engine_s, engine_tokens = timed(
            lambda: run_engine(server, prompts, args.n, args.max_tokens, args.seed), args.repeats
        )
        http = lambda: asyncio.run(run_http([address], prompts, args.n, args.max_tokens, args.seed))  # noqa: E731
        calls = server.context.num_batches
        http_s, http_tokens = timed(http, args.repeats)
        calls_per_run = (server.context.num_batches - calls) / (args.repeats + 1)
        assert all(len(t) == args.max_tokens for t in engine_tokens + http_tokens), "every sample has max_tokens"
        same = sum(a == b for a, b in zip(engine_tokens, http_tokens, strict=True))
        assert same == len(engine_tokens), f"only {same}/{len(engine_tokens)} samples agree between the paths"
        server.context.segment_tokens = args.segment_tokens
        seg_s, seg_tokens = timed(http, args.repeats)
        server.context.segment_tokens = None
        assert seg_tokens == http_tokens, "segmented decoding must sample the same tokens"
        engine_tps, http_tps, seg_tps = total / engine_s, total / http_s, total / seg_s
        print(f"engine direct:        {engine_tps:9.0f} tok/s ({engine_s:.2f} s, median of {args.repeats})")
        print(
            f"http (PolicyClient):  {http_tps:9.0f} tok/s ({http_s:.2f} s); {calls_per_run:.1f} engine calls per run "
            f"(engine path: {-(-len(engine_tokens) // args.max_seqs)})"
        )
        print(
            f"http, segments of {args.segment_tokens}: {seg_tps:9.0f} tok/s ({seg_s:.2f} s; information: the cost "
            f"of partial rollouts, {seg_tps / http_tps:.3f} of unsegmented)"
        )
        print(f"identical samples on both paths: {same}/{len(engine_tokens)}")
        vllm_comparison(args, model, tok, config, prompts, http_tps)
    finally:
        server.stop()
    print(f"http_over_engine={http_tps / engine_tps:.3f}")


if __name__ == "__main__":
    main()
