"""Arrow Flight transport: a Flight server in the learner process serves the latest published arrays.

Every tensor is cut into pieces of at most `broadcast.chunk_mb` MiB; consecutive small pieces are grouped so that
each Flight ticket carries about one chunk. The server answers a ticket with one record batch per piece, a uint8
column whose buffer is a view of the published array (no copy on the learner side). Servers fetch the tickets in
parallel threads and copy each piece into its place in preallocated arrays.

Flight actions: `latest` returns the manifest (JSON) of the last publish, so servers in other processes or on
other machines can poll for new weights when `broadcast.flight_port` is fixed.

Authentication: the server refuses every call (`do_get`, `do_action`, `list_flights`, `get_flight_info`, ...) that
does not carry the run's secret (`broadcast.secret`) as `authorization: Bearer <secret>`, with an Unauthenticated
error, before any handler runs (`_SecretAuthFactory`, a Flight server middleware); clients add the header to every
call (`_BearerFactory`, a client middleware). A learner-side transport with no configured secret makes a random one,
which only clients in its own process know.
"""

from __future__ import annotations

import hmac
import json
import secrets
import socket
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from marin_rl.broadcast.arrays import aligned_empty, byte_view, dtype_from_name, dtype_name, host_leaves
from marin_rl.broadcast.base import (
    BroadcastConfig,
    UpdateUnavailable,
    WeightTransport,
    WeightUpdate,
    register_transport,
)


def _manifest(version: int, publish_id: str, leaves: list[np.ndarray], chunk_bytes: int) -> dict[str, Any]:
    return {
        "version": int(version),
        "publish_id": publish_id,
        "chunk_bytes": int(chunk_bytes),
        "leaves": [{"dtype": dtype_name(x.dtype), "shape": list(x.shape), "nbytes": int(x.nbytes)} for x in leaves],
    }


def plan_tickets(manifest: dict[str, Any]) -> list[list[tuple[int, int, int]]]:
    """Tickets of a publish: each a list of (leaf, start byte, end byte) pieces of about `chunk_bytes` in all.

    Large tensors are cut into chunks; consecutive small pieces share a ticket. Both sides compute this from the
    manifest, so a ticket is named by its index alone.
    """
    chunk = manifest["chunk_bytes"]
    tickets: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    size = 0
    for i, leaf in enumerate(manifest["leaves"]):
        n = leaf["nbytes"]
        for start in range(0, max(n, 1), chunk):
            end = min(start + chunk, n)
            if current and size + (end - start) > chunk:
                tickets.append(current)
                current, size = [], 0
            current.append((i, start, end))
            size += end - start
    if current:
        tickets.append(current)
    return tickets


class _SecretAuthFactory(flight.ServerMiddlewareFactory):
    """Server middleware: rejects every call whose `authorization` header is not `Bearer <secret>`."""

    def __init__(self, secret: str):
        super().__init__()
        self._expected = f"Bearer {secret}".encode()

    def start_call(self, info, headers):
        values = headers.get("authorization", [])
        given = values[0] if len(values) == 1 else ""
        given = given.encode() if isinstance(given, str) else bytes(given)
        if not hmac.compare_digest(given, self._expected):
            raise flight.FlightUnauthenticatedError("the weight server needs the run's secret (broadcast.secret)")
        return None


class _Bearer(flight.ClientMiddleware):
    def __init__(self, header: str):
        super().__init__()
        self._header = header

    def sending_headers(self):
        return {"authorization": self._header}


class _BearerFactory(flight.ClientMiddlewareFactory):
    """Client middleware: every call carries `authorization: Bearer <secret>`."""

    def __init__(self, secret: str):
        super().__init__()
        self._header = f"Bearer {secret}"

    def start_call(self, info):
        return _Bearer(self._header)


class _WeightFlightServer(flight.FlightServerBase):
    """Serves the pieces of the last `keep` publishes to callers that carry `secret`; `latest` action returns the
    newest manifest."""

    def __init__(self, location: str, keep: int, secret: str):
        super().__init__(location, middleware={"auth": _SecretAuthFactory(secret)})
        self.keep = keep
        self._lock = threading.Lock()
        self._published: OrderedDict[str, tuple[dict, list[np.ndarray], list]] = OrderedDict()
        self._latest: dict | None = None

    def add(self, manifest: dict, leaves: list[np.ndarray]) -> None:
        views = [byte_view(x) for x in leaves]
        with self._lock:
            self._published[manifest["publish_id"]] = (manifest, views, plan_tickets(manifest))
            while len(self._published) > self.keep:
                self._published.popitem(last=False)
            self._latest = manifest

    def do_get(self, context, ticket):
        publish_id, index = ticket.ticket.decode().rsplit("/", 1)
        with self._lock:
            entry = self._published.get(publish_id)
        if entry is None:
            raise flight.FlightUnavailableError(
                f"weights {publish_id} are no longer served (only the last {self.keep}); fetch the latest update"
            )
        _, views, tickets = entry
        pieces = tickets[int(index)]
        schema = pa.schema([("bytes", pa.uint8())])

        def batches():
            for leaf, start, end in pieces:
                buf = pa.py_buffer(views[leaf][start:end])
                arr = pa.Array.from_buffers(pa.uint8(), end - start, [None, buf])
                yield pa.RecordBatch.from_arrays([arr], schema=schema)

        return flight.GeneratorStream(schema, batches())

    def do_action(self, context, action):
        if action.type != "latest":
            raise flight.FlightServerError(f"unknown action {action.type!r}; this server knows 'latest'")
        with self._lock:
            latest = self._latest
        yield flight.Result(pa.py_buffer(json.dumps(latest).encode()))

    def list_actions(self, context):
        return [("latest", "manifest of the last published weights (JSON), or null")]


@register_transport
class ArrowFlightTransport(WeightTransport):
    """Learner side: starts a Flight server on the first publish. Server side: fetches tickets in parallel."""

    name = "arrow_flight"

    def __init__(self, config: BroadcastConfig | None = None):
        super().__init__(config)
        self._server: _WeightFlightServer | None = None
        self._location: str | None = None
        self._secret = self.config.secret
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(self.config.fetch_threads, thread_name_prefix="flight-fetch")

    # ---- learner side ----------------------------------------------------------------------------------------
    @property
    def location(self) -> str:
        """grpc:// address of this process's Flight server (started if needed)."""
        if self._server is None:
            cfg = self.config
            if self._secret is None:  # only this process's clients can fetch
                self._secret = secrets.token_hex(32)
            self._server = _WeightFlightServer(f"grpc://{cfg.flight_host}:{cfg.flight_port}", cfg.keep, self._secret)
            host = socket.gethostname() if cfg.flight_host == "0.0.0.0" else cfg.flight_host
            self._location = f"grpc://{host}:{self._server.port}"
        assert self._location is not None
        return self._location

    def publish(self, version: int, params: Any) -> WeightUpdate:
        location = self.location
        leaves = host_leaves(params, self.config.dtype)
        update = WeightUpdate(version, self.name, None, sum(x.nbytes for x in leaves))
        manifest = _manifest(version, update.publish_id, leaves, self.config.chunk_mb << 20)
        assert self._server is not None
        self._server.add(manifest, leaves)
        update.payload = {"location": location, "manifest": manifest}
        self._latest = update
        return update

    # ---- server side -----------------------------------------------------------------------------------------
    def _client(self, location: str) -> flight.FlightClient:
        clients = getattr(self._local, "clients", None)
        if clients is None:
            clients = self._local.clients = {}
        if location not in clients:
            if self._secret is None:
                raise ValueError(
                    "broadcast.secret is not set, so this process cannot authenticate to the learner's Flight server; "
                    "set it to the secret the learner's run uses"
                )
            clients[location] = flight.FlightClient(location, middleware=[_BearerFactory(self._secret)])
        return clients[location]

    def latest(self) -> WeightUpdate | None:
        """The last publish: this process's own, or asked of the Flight server at `flight_host:flight_port`."""
        if self._server is not None:
            return self._latest
        cfg = self.config
        if cfg.flight_port == 0:
            raise ValueError(
                "broadcast.flight_port is 0, so servers cannot find the learner's Flight server to poll; "
                "set a fixed port (or push updates to the servers)"
            )
        location = f"grpc://{cfg.flight_host}:{cfg.flight_port}"
        results = list(self._client(location).do_action(flight.Action("latest", b"")))
        manifest = json.loads(results[0].body.to_pybytes())
        if manifest is None:
            return None
        nbytes = sum(leaf["nbytes"] for leaf in manifest["leaves"])
        return WeightUpdate(
            manifest["version"],
            self.name,
            {"location": location, "manifest": manifest},
            nbytes,
            publish_id=manifest["publish_id"],
        )

    def fetch(self, update: WeightUpdate) -> list[np.ndarray]:
        location, manifest = update.payload["location"], update.payload["manifest"]
        out = [aligned_empty(leaf["shape"], dtype_from_name(leaf["dtype"])) for leaf in manifest["leaves"]]
        views = [byte_view(x) for x in out]
        tickets = plan_tickets(manifest)

        def get(index: int) -> int:
            reader = self._client(location).do_get(flight.Ticket(f"{manifest['publish_id']}/{index}".encode()))
            received = 0
            for (leaf, start, end), chunk in zip(tickets[index], reader, strict=True):
                column = chunk.data.column(0)
                data = np.frombuffer(column.buffers()[1], np.uint8, count=len(column), offset=column.offset)
                if data.size != end - start:
                    raise RuntimeError(f"Flight piece of leaf {leaf} has {data.size} bytes, expected {end - start}")
                views[leaf][start:end] = data
                received += data.size
            return received

        try:
            received = sum(self._pool.map(get, range(len(tickets))))
        except flight.FlightUnavailableError as e:  # the learner's Flight server is gone with its process
            raise UpdateUnavailable(
                f"the Flight server at {location} that published version {update.version} does not answer ({e})"
            ) from None
        expected = sum(leaf["nbytes"] for leaf in manifest["leaves"])
        if received != expected:
            raise RuntimeError(f"fetched {received} bytes of weights {update.publish_id}, expected {expected}")
        return out

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None
        self._pool.shutdown(wait=False)
