"""Weight broadcast benchmark: publish → applied throughput of each transport against this machine's memcpy.

The model is a 134M-parameter Llama (hidden 768, 12 layers, 12 heads, MLP 2048, vocabulary 32000, untied
embeddings), randomly initialised; its float32 arrays (536 MB) are what the learner publishes. Each measurement
runs one whole hand-over in this process:

    publish   learner side: `transport.publish(version, model)` from the model's device arrays (the optional bf16
              cast runs on the device), through the transport (shared-memory slots, the object store, a Flight
              server, files);
    fetch     server side, through a transport object of its own: `latest()` (polled, for 'shared_memory',
              'arrow_flight' and 'fsspec') and `fetch`: host arrays;
    apply     `LevanterInferenceServer.apply_weights`: every array on the device in the served model's sharding and
              dtype (bf16 cast back to float32 on the device), swapped into the engine; it returns when the new
              weights are being served (then `transport.applied`, which lets 'shared_memory' reuse older slots).

"Applied" is exactly that: device arrays inside a real embedded server's model, ready for the next decode step.
In-host only: 'shared_memory' polls and maps slots in /dev/shm exactly as a server process would, 'ray' fetches
in the same process through the shared-memory store (a server actor on the same node reads it the same way),
'arrow_flight' over loopback gRPC, 'fsspec' through a local directory (page cache).

Throughput counts the model's float32 bytes per second of publish → applied, so a bf16 broadcast gets credit for
moving half the bytes. The baseline is `np.copyto` of a buffer of the model's size (best of 5) in the same run;
a copy into newly allocated memory (page faults included) is printed as well.
On a CPU device the float32 'in_process' hand-over moves nothing (the server's arrays alias the learner's, which
is safe: JAX arrays are immutable), so it is printed but left out of the best ratio. The last line is
`broadcast_over_memcpy=<best in-host ratio>`. Run: `python benchmarks/broadcast.py [--repeats 3]`; `--smoke` hands a
tiny model over once per transport (seconds; the test suite runs it so the benchmark cannot break unnoticed).
"""

from __future__ import annotations

import argparse
import logging
import secrets
import shutil
import tempfile
import time

import equinox as eqx
import haliax as hax
import jax
import numpy as np
from levanter.models.llama import LlamaConfig

from marin_rl.broadcast import BroadcastConfig, make_transport
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.model.build import parameter_count
from marin_rl.tokenizer import build_char_tokenizer


def llama_134m(smoke: bool = False) -> LlamaConfig:
    """A GPT-2-small-sized Llama: 134M parameters with a 32000-token vocabulary (smoke: a tiny one)."""
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
        max_seq_len=512,
        hidden_dim=768,
        intermediate_dim=2048,
        num_layers=12,
        num_heads=12,
        num_kv_heads=12,
        gradient_checkpointing=False,
        scan_layers=True,
        tie_word_embeddings=False,
    )


def memcpy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of `np.copyto` between two buffers of `nbytes` (best of `repeats`, after touching both)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.zeros_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return src.nbytes / best


def fresh_copy_bandwidth(nbytes: int, repeats: int = 3) -> float:
    """Bytes/s of copying a buffer of `nbytes` into newly allocated memory (`ndarray.copy`, best of `repeats`):
    what any hand-over that gives the server a new copy pays at least, page faults included."""
    src = np.ones(nbytes // 4, np.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst = src.copy()
        best = min(best, time.perf_counter() - t)
        del dst
    return src.nbytes / best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed hand-overs per transport (after one warm-up)")
    parser.add_argument("--transports", default="in_process,shared_memory,ray,arrow_flight,fsspec")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="broadcast.dtype values to measure")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one hand-over each (seconds)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats = 1
    logging.basicConfig(level=logging.WARNING)

    tok = build_char_tokenizer()
    t = time.perf_counter()
    model = llama_134m(args.smoke).build(hax.Axis("vocab", 1024 if args.smoke else 32000), key=jax.random.PRNGKey(0))
    leaves = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
    jax.block_until_ready(leaves)
    model_bytes = sum(x.nbytes for x in leaves)
    print(
        f"model: Llama {parameter_count(model) / 1e6:.1f}M parameters, {len(leaves)} arrays, "
        f"{model_bytes / 1e6:.0f} MB float32 (built in {time.perf_counter() - t:.1f} s)"
    )
    server = LevanterInferenceServer(
        model,
        tok,
        InferenceConfig(max_seqs=4, max_seq_len=128, levanter=LevanterServerConfig(page_size=64, prefill_tokens=512)),
        name="bench",
    )
    memcpy = memcpy_bandwidth(model_bytes)
    print(f"memcpy (np.copyto, {model_bytes / 1e6:.0f} MB, best of 5): {memcpy / 1e9:.2f} GB/s")
    fresh = fresh_copy_bandwidth(model_bytes)
    print(f"copy into new memory (ndarray.copy, best of 3): {fresh / 1e9:.2f} GB/s (information)")

    results: dict[tuple[str, str], dict[str, float]] = {}
    version = 0
    with tempfile.TemporaryDirectory(prefix="broadcast-bench-") as tmp:
        for name in args.transports.split(","):
            if name == "ray":
                import os

                import ray

                # Pre-fault the object store's memory so that publishes do not pay first-touch page faults
                # (measured here: 0.095 -> 0.27 of memcpy for 'ray' float32).
                os.environ.setdefault("RAY_preallocate_plasma_memory", "1")
                store = (256 << 20) if args.smoke else (3 << 30)
                ray.init(
                    address="local", num_cpus=2, object_store_memory=store, include_dashboard=False, log_to_driver=False
                )
            for dtype in args.dtypes.split(","):
                cast = None if dtype == "float32" else dtype
                # Slots belong on a memory filesystem; the others write files to the temporary directory.
                root = tempfile.mkdtemp(dir="/dev/shm") if name == "shared_memory" else tmp
                secret = secrets.token_hex(16)  # the run's secret, known to the learner and the servers
                cfg = BroadcastConfig(transport=name, dtype=cast, path=f"{root}/{name}-{dtype}", secret=secret)
                learner = make_transport(cfg)
                if name == "arrow_flight":  # the server side knows only the learner's address and the secret
                    port = int(learner.location.rsplit(":", 1)[1])
                    receiver = make_transport(BroadcastConfig(transport=name, flight_port=port, secret=secret))
                elif name in ("fsspec", "shared_memory"):
                    receiver = make_transport(cfg)
                else:
                    receiver = learner
                runs = []
                for i in range(args.repeats + 1):
                    version += 1
                    t0 = time.perf_counter()
                    learner.publish(version, model)
                    t1 = time.perf_counter()
                    update = receiver.latest()
                    assert update.version == version
                    fetched = receiver.fetch(update)
                    t2 = time.perf_counter()
                    server.apply_weights(version, fetched)
                    receiver.applied(update)
                    t3 = time.perf_counter()
                    del fetched, update
                    if i > 0:  # the first hand-over compiles the casts and warms caches
                        runs.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
                assert server.version == version
                total = sorted(runs, key=lambda r: r[3])[len(runs) // 2]  # the median hand-over
                results[(name, dtype)] = {"publish": total[0], "fetch": total[1], "apply": total[2], "total": total[3]}
                if receiver is not learner:
                    receiver.close()
                learner.close()
                if name == "shared_memory":
                    shutil.rmtree(root, ignore_errors=True)
            if name == "ray":
                ray.shutdown()
    server.stop()

    print(
        f"{'transport':<13} {'dtype':<9} {'publish s':>9} {'fetch s':>8} {'apply s':>8} {'total s':>8} "
        f"{'GB/s':>6} {'÷ memcpy':>8}"
    )
    best = 0.0
    for (name, dtype), r in results.items():
        rate = model_bytes / r["total"]
        ratio = rate / memcpy
        note = ""
        if name == "in_process" and dtype == "float32":
            note = "  (no bytes move: on a CPU device the server aliases the learner's buffers; not counted)"
        else:
            best = max(best, ratio)
        print(
            f"{name:<13} {dtype:<9} {r['publish']:>9.3f} {r['fetch']:>8.3f} {r['apply']:>8.3f} {r['total']:>8.3f} "
            f"{rate / 1e9:>6.2f} {ratio:>8.3f}{note}"
        )
    print(f"broadcast_over_memcpy={best:.3f}")


if __name__ == "__main__":
    main()
