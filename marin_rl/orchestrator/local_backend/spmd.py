"""Several hosts on the local backend: one process per host (SPMD, as `torchrun` or a TPU pod slice runs them), the
learner's mesh and the colocated engine spanning every host's devices.

Every process joins one JAX distributed runtime (`join`: the coordinator from the environment, as on TPU VMs) and
builds the same learner and engine. Process 0 runs the driver (environments, replay buffers, batcher, checkpoints'
run state, metrics); the others are followers (`follow`). The device work of a sharded learner and engine is a
sequence of multi-process programs that every process must run in the same order, so process 0 publishes it as an
ordered stream of commands (`CommandStream`, through the distributed runtime's key-value store): each learner call
(train step, warm start, checkpoint, export), each weight hand-over and each decode call with its input arrays.
A follower runs each command as it arrives with its own shards. On process 0, a command's work runs while it holds
the stream, so its learner thread and engine thread never interleave device work differently from the followers
(on several hosts generation and training take turns rather than overlap).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import threading
from collections.abc import Iterator
from typing import Any

import jax

from marin_rl.config import RunConfig
from marin_rl.learner.distributed import open_collectives

logger = logging.getLogger("marin_rl")

KEY_PREFIX = "marin_rl/commands/"
ENV_COORDINATOR = "MARIN_RL_COORDINATOR"
ENV_NUM_PROCESSES = "MARIN_RL_NUM_PROCESSES"
ENV_PROCESS_ID = "MARIN_RL_PROCESS_ID"
FOLLOWER_TIMEOUT_S = 24 * 3600
"""How long a follower waits for the next command (the driver may evaluate or checkpoint for long)."""


def join(config: RunConfig) -> None:
    """Join the JAX distributed runtime as one of `learner.hosts` processes (call before any device work).

    The coordinator ('host:port' of process 0), the process count and this process's id come from
    `MARIN_RL_COORDINATOR`, `MARIN_RL_NUM_PROCESSES` and `MARIN_RL_PROCESS_ID` when set; otherwise JAX detects them
    (TPU VMs, SLURM, ...). Raises ValueError naming what is missing or disagrees with `learner.hosts`."""
    hosts = config.learner.hosts
    coordinator = os.environ.get(ENV_COORDINATOR)
    num = os.environ.get(ENV_NUM_PROCESSES)
    pid = os.environ.get(ENV_PROCESS_ID)
    if num is not None and int(num) != hosts:
        raise ValueError(f"{ENV_NUM_PROCESSES}={num} but learner.hosts={hosts}: they must agree")
    if coordinator is not None and pid is None:
        raise ValueError(f"{ENV_COORDINATOR} is set but {ENV_PROCESS_ID} is not (this process's index, 0..{hosts - 1})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices' collectives (accelerators: theirs)
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=hosts if coordinator is not None else None,
        process_id=int(pid) if pid is not None else None,
    )
    if jax.process_count() != hosts:
        raise ValueError(f"the distributed runtime has {jax.process_count()} processes, learner.hosts={hosts}")
    open_collectives()
    logger.info(
        "local backend: process %d of %d, %d local devices of %d",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


class CommandStream:
    """The ordered device work of a multi-process run: process 0 `send`s, the others `receive` in the same order.

    `ordered(op, *args)` (process 0) holds the stream while the command is published and its work runs here, so two
    threads' commands reach the followers in the order their work runs. Commands travel through the distributed
    runtime's key-value store, pickled; each is deleted once every follower has taken it."""

    def __init__(self):
        from jax._src.distributed import global_state

        if global_state.client is None:
            raise RuntimeError("the JAX distributed runtime is not initialized (spmd.join first)")
        self._client = global_state.client
        self._lock = threading.RLock()
        self._next = 0
        self.followers = jax.process_count() - 1

    @contextlib.contextmanager
    def ordered(self, op: str, *args: Any) -> Iterator[None]:
        """Publish command (`op`, args) and hold the stream while its work runs here (process 0)."""
        with self._lock:
            self.send(op, *args)
            yield

    def send(self, op: str, *args: Any) -> None:
        """Publish the next command (process 0)."""
        with self._lock:
            self._client.key_value_set_bytes(f"{KEY_PREFIX}{self._next}", pickle.dumps((op, args)))
            self._next += 1

    def receive(self, timeout_s: float = FOLLOWER_TIMEOUT_S) -> tuple[str, tuple]:
        """The next command (a follower): (op, args)."""
        key = f"{KEY_PREFIX}{self._next}"
        payload = self._client.blocking_key_value_get_bytes(key, int(timeout_s * 1000))
        self._next += 1
        return pickle.loads(payload)


def follow(config: RunConfig) -> dict[str, Any]:
    """Run a follower process (process index > 0) of a multi-host local run: build the same learner and engine as
    process 0, then run its commands in order until it says stop. Returns `{"process": index, "commands": n}`."""
    from marin_rl.inference.levanter_server import LevanterInferenceServer
    from marin_rl.orchestrator.local_backend.learner import LocalLearner
    from marin_rl.tokenizer import load_tokenizer

    config.configure_jax()
    stream = CommandStream()
    tokenizer = load_tokenizer(config.tokenizer)
    learner = LocalLearner(config, tokenizer)
    server = LevanterInferenceServer(
        learner.model,
        tokenizer,
        config.inference,
        name=f"colocated-{jax.process_index()}",
        share_weights=True,
        compute_dtype=learner.compute_dtype,
    )
    engine = server.context.engine
    published = {-1: learner.model}  # version -> the policy the leader's engine serves as it
    done = 0
    try:
        while True:
            op, args = stream.receive()
            done += 1
            if op == "stop":
                break
            if op == "learner":
                method, margs = args
                result = getattr(learner, method)(*margs)
                if method == "publish":
                    published[result.version] = result.model
                    for old in sorted(published)[:-3]:
                        del published[old]
            elif op == "generate":
                version, inputs = args
                engine.model = published[version]
                with server.context.engine_scope():  # as process 0's engine thread runs it
                    engine.run(inputs)
            else:
                raise RuntimeError(f"unknown command {op!r} from process 0")
    finally:
        server.stop()
        learner.kill()
    logger.info("follower %d: %d commands run", jax.process_index(), done)
    return {"process": jax.process_index(), "commands": done}
