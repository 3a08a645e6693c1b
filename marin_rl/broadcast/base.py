"""Weight broadcast: the learner publishes `(version, params)`, every server fetches and applies them.

One interface, several transports that differ in how bytes travel:

* 'in_process'    — host copies of the arrays (learner and server in one process: tests, benchmarks);
* 'shared_memory' — slot files on a memory filesystem (/dev/shm) that the learner copies each version into and
                    servers on the same machine serve from in place (the fastest in-host transport);
* 'ray'           — one object in Ray's shared-memory object store, read zero-copy by servers on the same node and
                    pulled by servers on other nodes;
* 'arrow_flight'  — an Arrow Flight server in the learner process serves the latest version's arrays as zero-copy
                    record batches; servers fetch chunks in parallel threads (separate processes or machines);
* 'fsspec'        — a checkpoint directory (local path or gs://) written before a `latest` pointer names it, for
                    servers that load from disk.

Learner side: `publish(version, params)`. Server side: `latest()` (the last published update, for servers that
poll), `fetch(update)` (its arrays), a server's `apply_weights(version, leaves)`, then `applied(update)` (memory
held for older updates may be reused); `WeightSubscriber` wires them. 'auto' (the default) picks 'shared_memory'
on one machine and 'ray' otherwise. Each transport lives in a module of its own and registers itself by name
(`register_transport`); `make_transport` builds the one a config names. A server applies whatever was published
last — by publish id, never by comparing versions — so a learner that restarts from an earlier checkpoint at a
lower version is followed.

`broadcast.dtype` optionally casts floating parameters (on the learner's device when `params` are device arrays)
before they travel; servers cast back to their own parameter dtype when they apply (`marin_rl.broadcast.arrays`: the
host copies, casts and buffers the transports share). This module imports no JAX, so a config can name a transport
without loading it.
"""

from __future__ import annotations

import abc
import importlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from marin_rl.bounds import bounded, check_fields

logger = logging.getLogger(__name__)

TRANSPORT_MODULES = {
    "auto": "marin_rl.broadcast.auto",
    "in_process": "marin_rl.broadcast.in_process",
    "shared_memory": "marin_rl.broadcast.shared_memory",
    "ray": "marin_rl.broadcast.ray_object_store",
    "arrow_flight": "marin_rl.broadcast.arrow_flight",
    "fsspec": "marin_rl.broadcast.fsspec_checkpoint",
}
"""The built-in transports by name, and the module that defines (and registers) each: a transport's module is
imported only when it is used (pyarrow.flight, Ray, ... are loaded on demand)."""
DTYPES = ("bfloat16", "float32")


@dataclass
class BroadcastConfig:
    """How new weights reach the inference servers."""

    transport: str = "auto"
    """'auto' (default: 'shared_memory' when the run is on one machine and /dev/shm has room for the slots, else
    'ray'; decided at the first publish), 'shared_memory' (slots in /dev/shm: the fastest when every server runs on
    the learner's machine), 'ray' (the object store, any number of machines), 'in_process', 'arrow_flight' (a
    Flight server in the learner process, for servers in other processes or on other machines) or 'fsspec' (a
    checkpoint directory at `path`, for servers that load from disk)."""
    sync_every: int = bounded(1, ge=1)
    """Publish after every this many learner steps."""
    dtype: str | None = None
    """Cast floating parameters to this dtype before transfer ('bfloat16' halves the bytes; 'float32'); null sends
    them as they are. Servers cast back to their own parameter dtype when they apply."""
    path: str | None = None
    """'fsspec': directory (local path or gs://...) that holds the published versions and the `latest` pointer
    (required). 'shared_memory': directory on a memory filesystem for the slots and the `latest` pointer (default:
    a private directory under /dev/shm; name one for servers that poll)."""
    keep: int = bounded(2, ge=1)
    """'fsspec' and 'arrow_flight': how many of the most recent versions stay available (a server still fetching
    one of them can finish); older ones are deleted. 'shared_memory': how many model-sized slots may exist (at
    least 2: the one being served and the one being published; a publish waits while every slot is in use)."""
    flight_host: str = "127.0.0.1"
    """'arrow_flight': interface the learner's Flight server binds to and the address servers connect to. Use the
    learner machine's address when servers run on other machines ('0.0.0.0' binds all interfaces and advertises
    this machine's hostname)."""
    flight_port: int = bounded(0, ge=0, le=65535)
    """'arrow_flight': port of the learner's Flight server (0: any free port; servers then learn the address from
    the updates pushed to them, and `latest()` works only in the learner process). Set it for servers that poll."""
    chunk_mb: int = bounded(16, ge=1)
    """'arrow_flight' and 'fsspec': tensors travel in chunks of at most this many MiB, fetched in parallel."""
    fetch_threads: int = bounded(8, ge=1)
    """'arrow_flight' and 'fsspec': parallel threads a server fetches (and the learner writes) chunks with."""
    secret: str | None = None
    """'arrow_flight': secret that every call to the learner's Flight server must carry (`authorization: Bearer
    <secret>`); calls without it are refused. None: the run's driver makes a new random secret per run and hands
    it to the learner and the servers; set it for servers outside the run that poll the learner."""

    def __post_init__(self):
        if self.transport not in known_transports():
            raise ValueError(f"broadcast.transport must be one of {known_transports()}, got {self.transport!r}")
        check_fields(self, "broadcast")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"broadcast.dtype must be one of {list(DTYPES)} or null, got {self.dtype!r}")
        if self.transport == "fsspec" and not self.path:
            raise ValueError("broadcast.path is required for broadcast.transport 'fsspec' (a local directory or URL)")
        if self.secret is not None and (not isinstance(self.secret, str) or not self.secret.strip()):
            raise ValueError("broadcast.secret must be a non-empty string or null")


@dataclass
class WeightUpdate:
    """A published set of weights: the policy version and a transport-specific handle to the arrays."""

    version: int
    """Policy version (learner step) of the weights."""
    transport: str
    """Name of the transport that published it."""
    payload: Any
    """Transport-specific handle: the arrays, a Ray object ref, a Flight location and manifest, a directory."""
    num_bytes: int
    """Bytes that travel (after the optional dtype cast)."""
    publish_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Unique id of this publish; servers apply an update when its id differs from the last one they applied."""
    published_at: float = field(default_factory=time.time)
    """Unix time of the publish."""


class UpdateUnavailable(RuntimeError):
    """An update's arrays can no longer be fetched: the learner process that published them is gone (its slots
    removed, its objects lost), or a newer publish replaced them. The publisher's next update is the one to apply."""


class WeightTransport(abc.ABC):
    """Moves flattened parameter arrays from the learner to servers."""

    name: str

    def __init__(self, config: BroadcastConfig | None = None):
        self.config = config or BroadcastConfig(transport=self.name)
        self._latest: WeightUpdate | None = None

    @abc.abstractmethod
    def publish(self, version: int, params: Any) -> WeightUpdate:
        """Learner side: make `params` (a pytree such as the model, or a list of arrays) available as `version`."""

    def latest(self) -> WeightUpdate | None:
        """The last update published (None before the first). Transports that can see other processes' publishes
        ('arrow_flight', 'fsspec') override this; the others know only what this object published."""
        return self._latest

    @abc.abstractmethod
    def fetch(self, update: WeightUpdate) -> list[np.ndarray]:
        """Server side: the arrays of a published update, flattened like `eqx.filter(model, eqx.is_array)`."""

    def applied(self, update: WeightUpdate) -> None:  # noqa: B027 - most transports keep nothing after a fetch
        """Server side: `update` is being served now, so memory that earlier fetches still hold may be reused
        ('shared_memory' releases the slots of older updates)."""

    def close(self) -> None:  # noqa: B027 - most transports hold nothing to release
        """Release what the transport holds (servers, thread pools)."""


_REGISTRY: dict[str, type[WeightTransport]] = {}


def register_transport(cls: type[WeightTransport]) -> type[WeightTransport]:
    """Class decorator: make a `WeightTransport` subclass available under its `name` (`broadcast.transport`)."""
    _REGISTRY[cls.name] = cls
    return cls


def known_transports() -> list[str]:
    """Names `broadcast.transport` accepts: the built-in transports and any registered since."""
    return sorted(set(TRANSPORT_MODULES) | set(_REGISTRY))


def transport_class(name: str) -> type[WeightTransport]:
    """The transport class registered as `name` (a built-in one's module is imported on first use)."""
    if name not in _REGISTRY and name in TRANSPORT_MODULES:
        importlib.import_module(TRANSPORT_MODULES[name])
    if name not in _REGISTRY:
        raise ValueError(f"unknown broadcast transport {name!r}; known: {known_transports()}")
    return _REGISTRY[name]


def make_transport(config: BroadcastConfig | str) -> WeightTransport:
    """The transport that `config` names (a bare name uses that transport's defaults)."""
    if isinstance(config, str):
        config = BroadcastConfig(transport=config)
    return transport_class(config.transport)(config)


class WeightSubscriber:
    """Server side of a broadcast: fetches updates and hands them to `apply(version, leaves)`.

    `apply_update` applies a pushed update; `poll` applies the transport's latest one if it was not applied yet.
    Updates are told apart by publish id, not by version: whatever the learner published last is applied, also
    when its version is lower than the one being served (a learner restarted from an earlier checkpoint).
    """

    def __init__(self, transport: WeightTransport, apply: Callable[[int, list[np.ndarray]], Any]):
        self.transport = transport
        self.apply = apply
        self.applied: WeightUpdate | None = None

    def apply_update(self, update: WeightUpdate) -> dict[str, float]:
        """Fetch and apply `update`; returns its version, bytes and the fetch and apply seconds, plus the timings
        `apply` returned if it returned a dict (prefixed `apply/`)."""
        start = time.perf_counter()
        leaves = self.transport.fetch(update)
        fetched = time.perf_counter()
        details = self.apply(update.version, leaves)
        done = time.perf_counter()
        self.transport.applied(update)
        self.applied = update
        out = {
            "version": update.version,
            "bytes": update.num_bytes,
            "fetch_s": fetched - start,
            "apply_s": done - fetched,
        }
        if isinstance(details, dict):
            out.update({f"apply/{k}": v for k, v in details.items() if k not in ("version", "bytes")})
        return out

    def poll(self) -> dict[str, float] | None:
        """Apply the latest published update if it is not the one applied last; None when there is nothing new."""
        update = self.transport.latest()
        if update is None or (self.applied is not None and update.publish_id == self.applied.publish_id):
            return None
        return self.apply_update(update)
