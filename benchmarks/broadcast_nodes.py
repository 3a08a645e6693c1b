"""Cross-node weight hand-over: each transport between a learner actor on one Ray node and a server actor on
another, against this machine's memcpy.

Two Ray nodes run on this machine (the head on its own address, the second on 127.0.0.2, each with its own
raylet and object store), so bytes really cross from one node's store or process to the other's, over loopback
TCP. The learner actor (custom resource `learner_node`) publishes float32 arrays of a model's size (`--mb`,
default 536 MB: the 134M-parameter Llama of `benchmarks/broadcast.py`); the server actor (`rollout_node`) fetches
them as host arrays through its own transport object, as a `ServerActor` does before applying them:

    ray           the update's object ref; the server's node pulls the object from the learner's node
    arrow_flight  the learner's Flight server, bound to the learner node's address; the server fetches chunks
    fsspec        files under a directory both nodes see (here a local one; on a cluster a bucket)

A hand-over is timed from the publish call to the fetched arrays (applying them on the device is the same for
every transport and measured in `benchmarks/broadcast.py`). The baseline is `np.copyto` of a buffer of the same
size (best of 5) measured in the same run; each transport's figure is its median hand-over's bytes per second as a
ratio to it. The last two lines are `best_cross_node_transport=<name>` and `cross_node_over_memcpy=<its ratio>`.
`broadcast.transport: auto` uses `ray` across nodes. Run: `python benchmarks/broadcast_nodes.py [--repeats 3]`;
`--smoke` moves a few MB once per transport (seconds; the test suite runs it).
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import statistics
import tempfile
import time

import numpy as np
import ray
from ray._private.utils import get_ray_address_file
from ray.cluster_utils import Cluster

from marin_rl.broadcast import BroadcastConfig, make_transport

TRANSPORTS = ("ray", "arrow_flight", "fsspec")


def forget_cluster_address(address: str) -> None:
    """Remove Ray's record of `address` as this machine's cluster (written by `Cluster`), so that a later
    `ray.init()` starts a Ray of its own instead of connecting to the cluster that is gone."""
    path = get_ray_address_file(None)
    if os.path.exists(path) and open(path).read().strip() == address:
        os.remove(path)


def memcpy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return nbytes / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _arrays(total_bytes: int) -> list[np.ndarray]:
    """float32 arrays of a transformer's proportions: a few large (embeddings), many medium (layer weights)."""
    rng = np.random.default_rng(0)
    sizes = [total_bytes // 8] * 2 + [total_bytes * 3 // 4 // 24] * 24
    return [rng.standard_normal(max(1, n // 4), dtype=np.float32) for n in sizes]


@ray.remote(num_cpus=0, resources={"learner_node": 0.1})
class Publisher:
    def __init__(self, config: BroadcastConfig, total_bytes: int):
        if config.transport == "arrow_flight":
            config.flight_host = ray.util.get_node_ip_address()
        self.transport = make_transport(config)
        self.arrays = _arrays(total_bytes)
        self.nbytes = sum(a.nbytes for a in self.arrays)

    def node(self) -> str:
        return ray.util.get_node_ip_address()

    def publish(self, version: int):
        return self.transport.publish(version, self.arrays)

    def close(self) -> None:
        self.transport.close()


@ray.remote(num_cpus=0, resources={"rollout_node": 0.1})
class Receiver:
    def __init__(self, config: BroadcastConfig):
        self.transport = make_transport(config)

    def node(self) -> str:
        return ray.util.get_node_ip_address()

    def fetch(self, update) -> tuple[int, float]:
        arrays = self.transport.fetch(update)
        total = sum(int(a.nbytes) for a in arrays)
        checksum = float(arrays[0][:8].sum()) + float(arrays[-1][-8:].sum())  # touch the first and last bytes
        self.transport.applied(update)
        return total, checksum


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=536, help="float32 megabytes per version")
    parser.add_argument("--repeats", type=int, default=3, help="timed hand-overs per transport (after a warm-up)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--smoke", action="store_true", help="a few MB, one hand-over each (seconds)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.mb, args.repeats = 4, 1
    logging.basicConfig(level=logging.WARNING)
    total_bytes = args.mb * 1_000_000
    store = max(256 << 20, 3 * total_bytes)

    memcpy = memcpy_bandwidth(total_bytes)
    print(f"memcpy (np.copyto, {args.mb} MB, best of 5): {memcpy / 1e9:.2f} GB/s")
    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(num_cpus=1, resources={"learner_node": 1}, object_store_memory=store),
    )
    cluster.add_node(node_ip_address="127.0.0.2", num_cpus=1, resources={"rollout_node": 1}, object_store_memory=store)
    ray.init(address=cluster.address, log_to_driver=False)
    results: dict[str, float] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="broadcast-nodes-") as tmp:
            for name in args.transports.split(","):
                cfg = BroadcastConfig(transport=name, path=f"{tmp}/{name}", keep=2, secret=secrets.token_hex(16))
                learner, server = Publisher.remote(cfg, total_bytes), Receiver.remote(cfg)
                nodes = ray.get([learner.node.remote(), server.node.remote()])
                assert nodes[0] != nodes[1], f"learner and server on one node: {nodes}"
                times = []
                for version in range(args.repeats + 1):
                    t = time.perf_counter()
                    update = ray.get(learner.publish.remote(version))
                    nbytes, _ = ray.get(server.fetch.remote(update))
                    if version > 0:  # the first one warms connections and caches
                        times.append(time.perf_counter() - t)
                    del update
                assert nbytes >= total_bytes * 0.99, nbytes
                median = statistics.median(times)
                results[name] = nbytes / median / memcpy
                print(
                    f"{name:13s} {nodes[0]} -> {nodes[1]}: {median:.3f} s per version, "
                    f"{nbytes / median / 1e9:.2f} GB/s, {results[name]:.3f} of memcpy"
                )
                ray.get(learner.close.remote())
                for actor in (learner, server):
                    ray.kill(actor)
    finally:
        ray.shutdown()
        cluster.shutdown()
        forget_cluster_address(
            cluster.address
        )  # a later ray.init() starts its own Ray instead of looking for this cluster
    best = max(results, key=results.get)
    print(f"best_cross_node_transport={best}")
    print(f"cross_node_over_memcpy={results[best]:.3f}")


if __name__ == "__main__":
    main()
