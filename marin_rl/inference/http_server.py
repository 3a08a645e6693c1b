"""Serving an ASGI app with uvicorn from a daemon thread (every policy server's HTTP front end), the address a
server binds to and advertises (`inference.host`), completing a request's future from a worker thread, and the
keep-alive rule between our clients and servers."""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn

LOOPBACK = "127.0.0.1"

SERVER_KEEP_ALIVE_S = 60
"""Seconds our HTTP servers keep an idle connection open for its next request."""

CLIENT_KEEP_ALIVE_S = 2.0
"""Seconds our HTTP clients reuse an idle connection. Below every server's keep-alive (ours above; uvicorn's default,
which vLLM's server keeps, is 5 s), so a client never sends a request on a connection the server is closing at that
moment: that request would fail with `ReadError('')` (the server closed it without an answer) and, with one server,
fail its group."""


def client_limits(max_connections: int | None = 100, max_keepalive_connections: int | None = 20) -> httpx.Limits:
    """Connection limits for an httpx client of our servers or vLLM's: at most `max_connections` connections and
    `max_keepalive_connections` kept alive (None: no bound; the defaults are httpx's), each kept at most
    `CLIENT_KEEP_ALIVE_S` idle."""
    return httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_keepalive_connections,
        keepalive_expiry=CLIENT_KEEP_ALIVE_S,
    )


def resolve_future(future: asyncio.Future, result=None, error: Exception | None = None) -> None:
    """Complete `future` (awaited in the server's event loop) from another thread, once; later calls are ignored."""

    def done():
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    future.get_loop().call_soon_threadsafe(done)


def resolve_futures(answers: list[tuple[asyncio.Future, object]]) -> None:
    """Complete many futures with their results from another thread: one wake-up of each event loop they belong to
    (a call per future costs the loop a wake-up each)."""
    by_loop: dict = {}
    for future, result in answers:
        by_loop.setdefault(future.get_loop(), []).append((future, result))

    def done(pairs):
        for future, result in pairs:
            if not future.done():
                future.set_result(result)

    for loop, pairs in by_loop.items():
        loop.call_soon_threadsafe(done, pairs)


BATCH_WINDOW_CAP = 10
"""A batch stops growing this many batch timeouts after its first request arrived (`next_batch`)."""


def next_batch(
    requests: queue.Queue,
    stop: threading.Event,
    timeout: float,
    capacity: int,
    size: Callable[[Any], int] = lambda request: 1,
) -> list | None:
    """The next batch of queued requests for a server's batching thread: waits for a first one (None once `stop` is
    set), then grows while requests keep arriving less than `timeout` seconds apart, up to `capacity` (the requests'
    summed `size`) or `BATCH_WINDOW_CAP` timeouts in all."""
    while not stop.is_set():
        try:
            batch = [requests.get(timeout=0.1)]
        except queue.Empty:
            continue
        filled = size(batch[0])
        deadline = time.monotonic() + BATCH_WINDOW_CAP * timeout
        while filled < capacity:
            wait = min(timeout, deadline - time.monotonic())
            if wait <= 0:
                break
            try:
                batch.append(requests.get(timeout=wait))
            except queue.Empty:
                break
            filled += size(batch[-1])
        return batch
    return None


def bind_and_advertise(setting: str) -> tuple[str, str]:
    """(interface to bind, address clients use) for `inference.host`.

    'auto': loopback while the Ray cluster has one node (or Ray is not running), else the node's address as Ray
    knows it; 'node': the node's address; '0.0.0.0': every interface, advertising the node's address; anything
    else: that address for both.
    """
    if setting == "auto":
        setting = LOOPBACK if _ray_nodes() <= 1 else "node"
    if setting in ("node", "0.0.0.0"):
        node = _node_address()
        return (node if setting == "node" else "0.0.0.0"), node
    return setting, setting


def _ray() -> Any:
    """The Ray module when this process has joined a Ray cluster, else None (Ray is not imported for the asking:
    a process that never imported it has joined none, and may not have it installed)."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and ray.is_initialized() else None


def _ray_nodes() -> int:
    ray = _ray()
    return 1 if ray is None else sum(1 for n in ray.nodes() if n.get("Alive"))


def _node_address() -> str:
    ray = _ray()
    return LOOPBACK if ray is None else ray.util.get_node_ip_address()


class HttpServerThread:
    """A FastAPI app served by uvicorn in a daemon thread."""

    def __init__(self, host: str, name: str):
        """`host`: an `inference.host` setting ('auto', 'node', '0.0.0.0' or an address; see `bind_and_advertise`)."""
        self.host, self.advertised = bind_and_advertise(host)
        self.name = name
        self._uvicorn: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, app, port: int = 0) -> str:
        """Serve the ASGI `app` on `port` (0: any free one); returns the advertised 'host:port' once it accepts
        connections."""
        cfg = uvicorn.Config(
            app,
            host=self.host,
            port=port,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=SERVER_KEEP_ALIVE_S,
        )
        self._uvicorn = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._uvicorn.run, name=f"{self.name}-http", daemon=True)
        self._thread.start()
        deadline = time.time() + 60
        while not self._uvicorn.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"{self.name}: HTTP server failed to start")
            time.sleep(0.02)
        sock = self._uvicorn.servers[0].sockets[0].getsockname()
        return f"{self.advertised}:{sock[1]}"

    def stop(self) -> None:
        """Ask the server to exit and wait for its thread (at most 10 s)."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=10)
