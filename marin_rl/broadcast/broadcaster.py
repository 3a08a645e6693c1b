"""Weight broadcast: the learner publishes `(version, params)`, every server fetches and applies them.

Transports share one interface and differ in how bytes travel:
* 'in_process'  — the arrays themselves (learner and server in one process, tests and benchmarks);
* 'ray'         — one object in Ray's shared-memory object store, read zero-copy by servers on the same node and
                  pulled by servers on other nodes.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class BroadcastConfig:
    """How new weights reach the inference servers."""

    transport: str = "ray"
    """'ray' (object store; the default under the orchestrator) or 'in_process'."""
    sync_every: int = 1
    """Publish after every this many learner steps."""

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"broadcast.transport must be one of {sorted(TRANSPORTS)}, got {self.transport!r}")
        if self.sync_every < 1:
            raise ValueError("broadcast.sync_every must be >= 1")


@dataclass
class WeightUpdate:
    """A published set of weights: the policy version and a transport-specific handle to the arrays."""

    version: int
    transport: str
    payload: Any
    num_bytes: int


class WeightTransport(abc.ABC):
    """Moves flattened parameter arrays from the learner to servers."""

    name: str

    @abc.abstractmethod
    def publish(self, version: int, leaves: list[np.ndarray]) -> WeightUpdate:
        """Learner side: make `leaves` available as `version`."""

    @abc.abstractmethod
    def fetch(self, update: WeightUpdate) -> list[np.ndarray]:
        """Server side: the arrays of a published update."""


class InProcessTransport(WeightTransport):
    name = "in_process"

    def publish(self, version: int, leaves: list[np.ndarray]) -> WeightUpdate:
        return WeightUpdate(version, self.name, list(leaves), sum(x.nbytes for x in leaves))

    def fetch(self, update: WeightUpdate) -> list[np.ndarray]:
        return update.payload


class RayObjectStoreTransport(WeightTransport):
    name = "ray"

    def publish(self, version: int, leaves: list[np.ndarray]) -> WeightUpdate:
        import ray

        # A list wrapping the ref keeps Ray from resolving it when the update is passed to a server actor,
        # so servers fetch it themselves (and zero-copy on the same node).
        return WeightUpdate(version, self.name, [ray.put(list(leaves))], sum(x.nbytes for x in leaves))

    def fetch(self, update: WeightUpdate) -> list[np.ndarray]:
        import ray

        return ray.get(update.payload[0])


TRANSPORTS: dict[str, type[WeightTransport]] = {"in_process": InProcessTransport, "ray": RayObjectStoreTransport}


def make_transport(name: str) -> WeightTransport:
    """The transport registered under `name`."""
    return TRANSPORTS[name]()
