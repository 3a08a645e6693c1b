"""Serving an ASGI app with uvicorn from a daemon thread (every policy server's HTTP front end)."""

from __future__ import annotations

import threading
import time

import uvicorn


class HttpServerThread:
    """A FastAPI app served by uvicorn in a daemon thread."""

    def __init__(self, host: str, name: str):
        self.host = host
        self.name = name
        self._uvicorn: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, app, port: int = 0) -> str:
        """Serve the ASGI `app` on `port` (0: any free one); returns 'host:port' once it accepts connections."""
        cfg = uvicorn.Config(app, host=self.host, port=port, log_level="warning", access_log=False)
        self._uvicorn = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._uvicorn.run, name=f"{self.name}-http", daemon=True)
        self._thread.start()
        deadline = time.time() + 60
        while not self._uvicorn.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"{self.name}: HTTP server failed to start")
            time.sleep(0.02)
        sock = self._uvicorn.servers[0].sockets[0].getsockname()
        return f"{sock[0]}:{sock[1]}"

    def stop(self) -> None:
        """Ask the server to exit and wait for its thread (at most 10 s)."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=10)
