"""The learner across hosts: one process per host joins a JAX distributed runtime; the mesh spans all their devices.

Process 0 is the coordinator (`coordinator_address`); every process calls `initialize` before touching a device.
After that `jax.devices()` lists every host's devices, the learner's mesh covers them, each process computes its
shards, and every process runs the same sequence of steps (collectives). Host copies of sharded arrays come from
`host_arrays`, which gathers the pieces other hosts hold when a process does not hold a whole array itself. Side
effects that must happen once (publishing weights, writing JSON beside a checkpoint) happen on the primary process.
"""

from __future__ import annotations

import logging
import socket

import jax
import numpy as np

logger = logging.getLogger(__name__)


def coordinator_address(host: str | None = None) -> str:
    """'host:port' for process 0 to serve the distributed runtime on: this node's address (as Ray knows it when Ray
    runs, else `host` or 127.0.0.1) and a free port."""
    if host is None:
        try:
            import ray

            host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        except Exception:  # not in a Ray worker
            host = "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return f"{host}:{port}"


def initialize(coordinator: str, num_processes: int, process_id: int, timeout_s: int = 300) -> None:
    """Join the distributed runtime as process `process_id` of `num_processes` (call before any device work).

    Collectives between the processes' CPU devices go through Gloo (accelerators use their own interconnect).
    """
    if num_processes <= 1:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout_s,
    )
    open_collectives(timeout_s)
    logger.info(
        "learner process %d of %d: %d local devices of %d (coordinator %s)",
        process_id,
        num_processes,
        jax.local_device_count(),
        jax.device_count(),
        coordinator,
    )


def open_collectives(timeout_s: int = 300) -> None:
    """Meet the other processes, then run one collective so that the Gloo context exists before any real work.

    Gloo sets its context up at the first collective and waits only 30 s (fixed in XLA) for every process to get
    there; processes that start unevenly (one slowed by a busy host while the other builds its model) fail there. A
    barrier of the runtime's coordination service, whose timeout is ours, lines them up first; collectives after the
    context exists wait as long as XLA's collective timeout (30 minutes).
    """
    from jax._src import distributed as jax_distributed
    from jax.experimental import multihost_utils

    jax_distributed.global_state.client.wait_at_barrier("marin_rl/collectives", timeout_in_ms=timeout_s * 1000)
    multihost_utils.sync_global_devices("marin_rl/collectives")


def is_primary() -> bool:
    """Whether this is process 0 (the one that publishes weights and writes single-copy files)."""
    return jax.process_index() == 0


def host_arrays(leaves: list) -> list[np.ndarray]:
    """Host (NumPy) copies of JAX arrays. An array this process does not hold whole (sharded over other hosts'
    devices) is gathered from every process; then every process must call this with the same arrays."""
    local = [not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves]
    if all(local):
        return [np.asarray(x) for x in jax.device_get(leaves)]
    from jax.experimental import multihost_utils

    out = []
    for x, is_local in zip(leaves, local, strict=True):
        if is_local:
            out.append(np.asarray(jax.device_get(x)))
        else:
            out.append(np.asarray(multihost_utils.process_allgather(x, tiled=True)))
    return out
