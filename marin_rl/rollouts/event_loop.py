"""`BackgroundLoop`: an asyncio event loop running in its own daemon thread, and the ways to run coroutines on it
from other threads (blocking, in the background, or awaited from another loop)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any


class BackgroundLoop:
    """An event loop in a daemon thread named `name`, started at construction and ended by `stop`."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run `coro` on the loop and block for its result (at most `timeout` seconds). Refused on the loop's own
        thread, where it would wait for itself."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("blocking InferenceEngine calls cannot run on the engine's own event loop")
        return self.start(coro).result(timeout)

    def start(self, coro: Coroutine) -> concurrent.futures.Future:
        """Schedule `coro` on the loop from any thread; returns its future without waiting."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine) -> Any:
        """Await `coro` on the loop from any event loop (directly when that is this loop)."""
        if _running_loop() is self.loop:
            return await coro
        return await asyncio.wrap_future(self.start(coro))

    def stop(self, timeout: float = 30) -> None:
        """Stop the loop and wait (at most `timeout` seconds) for its thread to end."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=timeout)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
