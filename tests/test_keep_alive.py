"""A client never sends a request on a kept-alive connection that the server is closing at that moment.

An HTTP server closes a connection that stays idle for its keep-alive (uvicorn's default, which vLLM keeps, is 5 s);
a client that reuses a connection idle for about as long sends its request into that close and gets
`ReadError('')`, which fails a group when there is one server (seen in CI: the Python API's example loop, one embedded
server, `ServerUnreachable(... ReadError(''))` at version 172). Our clients let an idle connection go well before any
server would (`CLIENT_KEEP_ALIVE_S`).
"""

from __future__ import annotations

import asyncio
import random

import uvicorn
from fastapi import FastAPI

from marin_rl.inference import http_server
from marin_rl.inference.client import PolicyClient
from marin_rl.inference.http_server import CLIENT_KEEP_ALIVE_S, SERVER_KEEP_ALIVE_S, HttpServerThread


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict) -> dict:
        return {"choices": []}

    return app


def test_clients_let_idle_connections_go_before_any_server_closes_them():
    uvicorn_default = uvicorn.Config(_app()).timeout_keep_alive  # what vLLM's server keeps
    assert CLIENT_KEEP_ALIVE_S < min(SERVER_KEEP_ALIVE_S, uvicorn_default) / 2
    server = HttpServerThread("127.0.0.1", "keep-alive")
    address = server.start(_app())
    try:
        assert server._uvicorn.config.timeout_keep_alive == SERVER_KEEP_ALIVE_S
        client = PolicyClient([address])
        assert client._http[address]._transport._pool._keepalive_expiry == CLIENT_KEEP_ALIVE_S
    finally:
        server.stop()


def test_requests_sent_as_the_server_closes_idle_connections_all_succeed(monkeypatch):
    """Time scaled down 100x (server keep-alive 50 ms, client 25 ms): requests sent after idle gaps of the server's
    keep-alive, give or take 5 ms. With the client keeping connections as long as httpx's default (5 s), about one
    in twenty of these fails with `ReadError('')`."""
    keep_alive = 0.05
    monkeypatch.setattr(http_server, "SERVER_KEEP_ALIVE_S", keep_alive)
    monkeypatch.setattr(http_server, "CLIENT_KEEP_ALIVE_S", keep_alive / 2)
    server = HttpServerThread("127.0.0.1", "keep-alive")
    address = server.start(_app())
    rng = random.Random(0)

    async def send_after_idle_gaps(count: int) -> int:
        client = PolicyClient([address])
        for _ in range(count):
            await asyncio.sleep(keep_alive + rng.uniform(-0.005, 0.005))
            await client._post(address, {"prompt": [1]})  # raises on a transport error
        return count

    try:
        assert asyncio.run(send_after_idle_gaps(200)) == 200
    finally:
        server.stop()
