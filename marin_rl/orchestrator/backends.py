"""The seam between the driver loop and a backend: what both backends provide (`Backend`), and `make_backend`.

The driver (`marin_rl.orchestrator.orchestrator.Orchestrator`), its checkpoints and its warm start use a backend
only through this protocol. Two implement it:

* `marin_rl.orchestrator.ray_backend.backend.RayBackend` (`orchestrator.backend: ray`): Ray actors for the learner
  processes, the inference servers and the env workers, supervised and replaced when they die.
* `marin_rl.orchestrator.local_backend.backend.LocalBackend` (`orchestrator.backend: local`): one process per host,
  the embedded engine sampling from the learner's own weights; Ray is never imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from marin_rl.config import RunConfig
from marin_rl.rollouts.controller import RolloutController, WorkerPool

if TYPE_CHECKING:
    from marin_rl.orchestrator.local_backend.backend import LocalBackend
    from marin_rl.orchestrator.ray_backend.backend import RayBackend


class Backend(Protocol):
    """What the driver loop needs of a backend: its parts, starting and stopping them, waiting, weights, evaluation,
    checkpoints and the warm start."""

    config: RunConfig
    """The run's config (as the backend's processes get it)."""
    learner: Any
    """The learner's processes: a handle whose `run(method, *args)` calls every process (None before `start`)."""
    servers: Any
    """The inference servers (their `stats()`), None before `start`."""
    pools: Mapping[str, WorkerPool]
    """Each environment's worker pool."""
    rollouts: RolloutController | None
    """The rollout pipeline over the pools (None before `start`)."""
    learner_errors: tuple[type[BaseException], ...]
    """What a dead learner process raises; the loop replaces the learner and rolls back (empty: no in-run
    replacement)."""

    def start_backend(self) -> None:
        """Start what the parts run on (Ray, or nothing)."""

    def start(self) -> None:
        """Start the learner, the servers, the env workers and the rollout controller."""

    def start_learner(self, wait: bool) -> Any:
        """Replace the learner's processes (after one died); refused where there is no in-run replacement."""

    def wait(self, training: Any, timeout_s: float) -> None:
        """Block until a group or the learner step `training` finishes, at most `timeout_s`."""

    def shutdown(self) -> None:
        """Stop every part."""

    def begin_checkpoint(self, root: str, step: int) -> str:
        """Prepare the checkpoint directory of `step` under `root`; returns it."""

    def check_servers(self) -> None:
        """Notice dead servers and replace them (nothing to do in one process)."""

    def broadcast(self) -> dict[str, float]:
        """Publish the learner's weights and wait until every server serves them; returns `broadcast/...` metrics."""

    def publish(self) -> dict[str, float]:
        """The learner publishes its current weights; returns `broadcast/publish_s`."""

    def apply_published(self) -> dict[str, float]:
        """Every server applies what `publish` made; returns `broadcast/...` metrics."""

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the served policy (`eval/...`)."""

    def warm_start_examples(self) -> list[Any]:
        """The supervised examples of the warm start, from every environment's reference answers."""


def make_backend(
    config: RunConfig, section: Callable[[str], contextlib.AbstractContextManager], count: Callable[..., None]
) -> RayBackend | LocalBackend:
    """The run's backend for `orchestrator.backend`: Ray actors (`RayBackend`), or everything in this process, the
    engine sampling from the learner's own weights (`LocalBackend`: Ray is never imported). `section(name)` and
    `count(**counters)` receive the rollout controller's profile timings and counters."""
    if config.orchestrator.backend == "local":
        from marin_rl.orchestrator.local_backend.backend import LocalBackend

        return LocalBackend(config, section=section, count=count)
    from marin_rl.orchestrator.ray_backend.backend import RayBackend

    return RayBackend(config, section=section, count=count)


def run_as_follower(config: RunConfig) -> dict[str, Any] | None:
    """A local run over several hosts (`learner.hosts > 1`, one process per host, SPMD): join the other processes;
    on every process but the first, run as a follower of the driver's device work until the run ends and return
    its result. None where this process drives the run (every Ray run, every one-host local run, process 0)."""
    if config.orchestrator.backend != "local" or config.learner.hosts <= 1:
        return None
    import jax

    from marin_rl.orchestrator.local_backend import spmd

    spmd.join(config)
    if jax.process_index() != 0:
        return spmd.follow(config)
    return None
