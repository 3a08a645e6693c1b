"""LoRA against full fine-tuning, same model, one run: bytes and seconds per weight update, optimizer-state bytes
and the learner's step time.

For each model (the quickstart's 0.56M-parameter Llama, and a 134M-parameter Llama: hidden 768, 12 layers, MLP 2048,
vocabulary 32000) two learners are built from the same initial weights: one trains every parameter, one trains
LoRA adapters (`learner.lora`) on every linear layer. For each:

    update     what one version costs from the learner's arrays to a server serving them, in this process:
               `learner.publish_params()` through the 'shared_memory' transport (publish, then a second transport
               object's `latest` + `fetch`, as a server process does) and `LevanterInferenceServer.apply_weights`
               (with LoRA: the server merges the adapters into its base, on the device). The first (full) publish
               of a LoRA learner carries the base; the figures are those of later versions (adapters only).
    optimizer  bytes of the RL optimizer's state (AdamW: two moments per trained parameter).
    step       the median `Learner.train_step` time on a random packed batch (`--rows` rows of `--seq` tokens).
    serving    how a server could apply the adapters: a forward pass computing with them (two small matmuls more per
               linear layer) against one of the merged model, and what one merge costs (once per version).

The last line is `lora_bytes_over_full=<bytes per update with LoRA ÷ without, the larger model's>`.
Run: `python benchmarks/lora.py [--ranks 4,8] [--steps 3]`; `--smoke` runs a tiny model for two steps (seconds).
"""

from __future__ import annotations

import argparse
import logging
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

import equinox as eqx
import haliax as hax
import jax
import numpy as np
from levanter.models.llama import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from random_packed_batch import random_packed_batch  # noqa: E402

from marin_rl.broadcast import BroadcastConfig, make_transport  # noqa: E402
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig  # noqa: E402
from marin_rl.inference.levanter_server import LevanterInferenceServer  # noqa: E402
from marin_rl.learner.config import LearnerConfig
from marin_rl.learner.learner import Learner  # noqa: E402
from marin_rl.model import lora  # noqa: E402
from marin_rl.model.build import build_model  # noqa: E402
from marin_rl.model.config import LoraConfig, ModelConfig
from marin_rl.model.logprobs import token_logprobs  # noqa: E402
from marin_rl.tokenizer import build_char_tokenizer  # noqa: E402


def llama(hidden: int, mlp: int, layers: int, heads: int) -> LlamaConfig:
    return LlamaConfig(
        max_seq_len=512,
        hidden_dim=hidden,
        intermediate_dim=mlp,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        gradient_checkpointing=False,
        scan_layers=True,
        tie_word_embeddings=False,
    )


MODELS = {
    "smoke": (llama(32, 64, 1, 2), 64),
    "quickstart 0.56M": (llama(128, 512, 2, 4), 40),
    "llama 134M": (llama(768, 2048, 12, 12), 32000),
}


def measure(arch: LlamaConfig, vocab: int, rank: int, args, tok) -> dict[str, float]:
    """Update bytes and seconds, optimizer bytes and step time of one learner (rank 0: full fine-tuning)."""
    model_config = ModelConfig(architecture=arch)
    config = LearnerConfig(lora=LoraConfig(rank=rank, alpha=2.0 * max(rank, 1)))
    learner = Learner(model_config, config, vocab)
    learner.add_adapters()
    server = LevanterInferenceServer(
        build_model(model_config, vocab),
        tok,
        InferenceConfig(max_seqs=4, max_seq_len=128, levanter=LevanterServerConfig(engine="dense")),
        name="bench",
        lora=config.lora,
    )
    root = tempfile.mkdtemp(dir="/dev/shm", prefix="lora-bench-")
    cfg = BroadcastConfig(transport="shared_memory", path=f"{root}/slots", secret=secrets.token_hex(16))
    sender, receiver = make_transport(cfg), make_transport(cfg)
    updates = []
    try:
        for version in range(args.updates + 2):  # the first is the full publish, the second warms up
            t0 = time.perf_counter()
            update = sender.publish(version, learner.publish_params())
            latest = receiver.latest()
            fetched = receiver.fetch(latest)
            server.apply_weights(version, fetched)
            receiver.applied(latest)
            elapsed = time.perf_counter() - t0
            if version >= 2:
                updates.append((update.num_bytes, elapsed))
            del fetched
    finally:
        receiver.close()
        sender.close()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    opt_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(learner.opt_state) if hasattr(x, "nbytes"))
    steps = []
    for seed in range(args.steps + 1):
        batch = random_packed_batch(seed, rows=args.rows, seq=args.seq, vocab=vocab, segments=4)
        t = time.perf_counter()
        learner.train_step(batch)
        if seed > 0:  # the first compiles
            steps.append(time.perf_counter() - t)
    sizes = lora.lora_bytes(learner.model)
    serve = serving_forward(learner, vocab, args) if rank else {}
    return {
        **serve,
        "params": sizes["base"] / 4,
        "trained": (sizes["adapters"] if rank else sizes["base"]) / 4,
        "bytes": float(np.median([b for b, _ in updates])),
        "update_s": float(np.median([s for _, s in updates])),
        "optimizer_bytes": float(opt_bytes),
        "step_s": float(np.median(steps)),
    }


def serving_forward(learner: Learner, vocab: int, args) -> dict[str, float]:
    """How a server could apply adapters: the median forward pass (`--serve-rows` rows of `--serve-seq` tokens, the
    shape of a decode batch's prefill) of the adapted model, computing with the adapters, against the merged model,
    and the seconds one merge takes (once per version)."""
    rows, seq = args.serve_rows, args.serve_seq
    batch = random_packed_batch(7, rows=rows, seq=seq, vocab=vocab, segments=1)
    names = ("input_ids", "position_ids", "segment_ids")
    axes = (hax.Axis("batch", rows), hax.Axis("position", seq))
    inputs = [hax.named(getattr(batch, k), axes) for k in names]
    forward = eqx.filter_jit(lambda m, *xs: token_logprobs(m, *xs)[0].array)
    merge = eqx.filter_jit(lora.merged)

    def median_s(fn, repeats: int = 5) -> float:
        jax.block_until_ready(fn())  # compile
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t)
        return float(np.median(times))

    merged = merge(learner.model)
    return {
        "forward_adapters_s": median_s(lambda: forward(learner.model, *inputs)),
        "forward_merged_s": median_s(lambda: forward(merged, *inputs)),
        "merge_s": median_s(lambda: merge(learner.model)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="4,8", help="LoRA ranks to measure against full fine-tuning")
    parser.add_argument("--steps", type=int, default=3, help="timed train steps per learner (after one compile)")
    parser.add_argument("--updates", type=int, default=3, help="timed weight updates per learner (after two)")
    parser.add_argument("--rows", type=int, default=4, help="rows per train batch")
    parser.add_argument("--seq", type=int, default=512, help="tokens per row")
    parser.add_argument("--serve-rows", type=int, default=64, help="rows of the serving forward pass")
    parser.add_argument("--serve-seq", type=int, default=64, help="tokens per row of the serving forward pass")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, two steps (seconds)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    names = ["smoke"] if args.smoke else ["quickstart 0.56M", "llama 134M"]
    if args.smoke:
        args.steps, args.updates, args.rows, args.seq, args.ranks = 1, 1, 2, 64, "2"
        args.serve_rows, args.serve_seq = 4, 16
    ranks = [int(r) for r in args.ranks.split(",")]
    tok = build_char_tokenizer()
    print(f"{jax.devices()[0].device_kind} ({jax.devices()[0].platform}), {len(jax.devices())} device(s)")
    header = (
        f"{'model':<17} {'rank':>5} {'trained':>12} {'MB/update':>10} {'÷ full':>7} {'s/update':>9} "
        f"{'optimizer MB':>12} {'step s':>7}"
    )
    print(header)
    ratio = 0.0
    for name in names:
        arch, vocab = MODELS[name]
        full = measure(arch, vocab, 0, args, tok)
        rows = [(0, full)] + [(r, measure(arch, vocab, r, args, tok)) for r in ranks]
        for rank, m in rows:
            share = m["bytes"] / full["bytes"]
            print(
                f"{name:<17} {('full' if rank == 0 else rank):>5} {m['trained']:>12,.0f} {m['bytes'] / 1e6:>10.3f} "
                f"{share:>7.4f} {m['update_s']:>9.4f} {m['optimizer_bytes'] / 1e6:>12.2f} {m['step_s']:>7.3f}"
            )
        for rank, m in rows[1:]:
            print(
                f"{name:<17} rank {rank}: serving forward ({args.serve_rows}x{args.serve_seq} tokens) computing with "
                f"the adapters {m['forward_adapters_s'] * 1e3:.2f} ms, merged {m['forward_merged_s'] * 1e3:.2f} ms; "
                f"one merge {m['merge_s'] * 1e3:.2f} ms"
            )
        ratio = rows[1][1]["bytes"] / full["bytes"]
    print(f"lora_bytes_over_full={ratio:.4f}")


if __name__ == "__main__":
    main()
