"""`LocalLearner`: the learner of the local backend in this process (a `TrainEngine` whose calls run in order on a
worker thread), with the surface of the Ray `LearnerGroup`; and the process's memory figures.

On several hosts (`marin_rl.orchestrator.local_backend.spmd`) process 0's learner publishes each call to the
followers, whose `LocalLearner`s run the same calls.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import resource
from dataclasses import dataclass
from typing import Any

import jax

from marin_rl.api.train import TrainEngine
from marin_rl.checkpoint_dirs import begin_checkpoint
from marin_rl.config import RunConfig
from marin_rl.orchestrator.learner_methods import LearnerMethods
from marin_rl.types import PackedBatch


def process_memory() -> dict[str, float]:
    """This process's resident memory now and at its peak (MB), and the first device's bytes in use and peak where
    the device reports them (accelerators; a CPU device does not)."""
    out = {"memory/host_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/statm") as f:
            out["memory/host_rss_mb"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_in_use" in stats:
        out["memory/device_mb"] = stats["bytes_in_use"] / 2**20
    if "peak_bytes_in_use" in stats:
        out["memory/device_peak_mb"] = stats["peak_bytes_in_use"] / 2**20
    return out


@dataclass
class ColocatedUpdate:
    """A version handed from the learner to the colocated engine: the learner's policy itself (no arrays copied)."""

    version: int
    model: Any
    transport: str = "colocated"
    num_bytes: int = 0
    """Bytes the hand-over sends anywhere: none."""


class LocalLearner(LearnerMethods):
    """The learner in this process, with the surface of the Ray `LearnerGroup`: `call(method, *args)` queues a call
    on the learner's thread (one call at a time, in order) and returns its handle; `finished`, `get` and `run` as
    there. The methods are those of the Ray `LearnerActor` (those the two share: `LearnerMethods`)."""

    def __init__(self, config: RunConfig, tokenizer):
        self.engine = TrainEngine(config, tokenizer=tokenizer, transport=False)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="learner")
        self.stream: Any = None  # a `marin_rl.orchestrator.local_backend.spmd.CommandStream` (spmd imports this module)
        """Several hosts (process 0): every call is published to the followers and runs while holding the stream."""

    @property
    def model(self):
        """The learner's current policy (its device arrays)."""
        return self.engine.learner.model

    @property
    def compute_dtype(self) -> str:
        """The dtype the learner computes in (`model.compute_dtype` resolved); the colocated engine samples in it."""
        return self.engine.learner.policy_setup.compute_dtype

    # ---- the LearnerGroup surface ---------------------------------------------------------------------------
    def call(self, method: str, *args) -> list[concurrent.futures.Future]:
        """Run `method` on the learner's thread; its handle (a one-element list, like one call per process)."""
        return [self._thread.submit(self._invoke, method, args)]

    def _invoke(self, method: str, args: tuple) -> Any:
        if self.stream is None:
            return getattr(self, method)(*args)
        with self.stream.ordered("learner", method, args):  # the followers run the same call, in the same order
            result = getattr(self, method)(*args)
            jax.block_until_ready(self.engine.learner.model)
            return result

    def run(self, method: str, *args) -> Any:
        """Run `method` and return its result."""
        return self.get(self.call(method, *args))[0]

    @staticmethod
    def get(handles: list[concurrent.futures.Future]) -> list[Any]:
        """The results of a call (raising its error)."""
        return [h.result() for h in handles]

    @staticmethod
    def finished(handles: list[concurrent.futures.Future]) -> bool:
        """Whether a call has finished, without blocking; raises its error."""
        if not all(h.done() for h in handles):
            return False
        for h in handles:
            h.result()
        return True

    def owns(self, error: BaseException) -> bool:
        """Never: a learner error in this process ends the run (rerun the command to resume)."""
        return False

    def kill(self) -> None:
        """Stop the learner's thread: a warm start in progress ends after its current step, any other call after it
        finishes."""
        self.engine.learner.interrupted.set()
        self._thread.shutdown(wait=True, cancel_futures=True)

    # ---- the LearnerActor methods ---------------------------------------------------------------------------
    def train_step(self, batch: PackedBatch) -> dict[str, float]:
        """One training step on `batch`; returns the `learner/...` metrics and the process's memory after it."""
        metrics = self.engine.train_batch(batch)
        metrics.update({f"{k}/after_train": v for k, v in process_memory().items()})
        return metrics

    def publish(self) -> ColocatedUpdate:
        """The current policy as its version: a reference to the learner's arrays."""
        return ColocatedUpdate(self.engine.version, self.engine.learner.served_model())

    def close(self) -> None:
        """Nothing to release (no transport)."""

    def begin_checkpoint(self, root: str, step: int) -> str:
        """Prepare the checkpoint directory of `step` (every process of a multi-host run: they synchronise)."""
        return begin_checkpoint(root, step)
