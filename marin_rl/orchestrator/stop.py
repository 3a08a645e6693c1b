"""`StopRequest`: SIGINT and SIGTERM ask a run to stop at its next safe point."""

from __future__ import annotations

import logging
import signal
import threading

logger = logging.getLogger("marin_rl")


class StopRequest:
    """A request to stop at the next safe point (after the learner step in progress, with a checkpoint).

    `run` installs it as the SIGINT and SIGTERM handler: while the loop is running (`armed`), the first signal asks
    for a clean stop; a second one, or one before the loop runs, raises KeyboardInterrupt at once.
    """

    def __init__(self):
        self.requested = False
        self.armed = False

    def install(self) -> dict:
        """Handle SIGINT and SIGTERM (from the main thread only; elsewhere a no-op); returns the previous handlers."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}

    def uninstall(self, previous: dict) -> None:
        """Put back the handlers `install` replaced."""
        for s, handler in previous.items():
            if handler is not None:  # None: a handler not installed from Python, which cannot be put back
                signal.signal(s, handler)

    def __call__(self, signum, frame):
        if self.armed and not self.requested:
            self.requested = True
            logger.warning(
                "signal %d: stopping after the current learner step and saving a checkpoint (again to abort)", signum
            )
            return
        raise KeyboardInterrupt(f"signal {signum}")
