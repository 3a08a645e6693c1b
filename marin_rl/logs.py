"""Logging setup for the driver, the actors and the programs: our loggers at INFO, third-party ones quiet, and no
colour codes in what is not a terminal (a log file, a CI log, a Ray actor's output)."""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import TextIO

QUIET_LOGGERS = ("levanter", "jax", "absl", "httpx", "uvicorn", "openai", "urllib3", "ray", "tqdm_loggable")
"""Third-party loggers that only report errors."""

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
"""Every line: time, logger, level, message."""

ANSI_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
"""ANSI control sequences (colours, cursor moves)."""


def strip_ansi(text: str) -> str:
    """`text` without ANSI control sequences."""
    return ANSI_ESCAPE.sub("", text)


def is_terminal(stream: TextIO | None) -> bool:
    """Whether `stream` is an interactive terminal (False for files, pipes, closed or missing streams)."""
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):
        return False


class PlainFormatter(logging.Formatter):
    """`LOG_FORMAT`, with ANSI control sequences removed from the whole line unless `color` (the handler writes to a
    terminal): a message that carries colour (a library's, a subprocess's output) stays readable in a file."""

    def __init__(self, fmt: str = LOG_FORMAT, *, color: bool = False):
        super().__init__(fmt)
        self.color = color

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if self.color else strip_ansi(text)


class StderrHandler(logging.StreamHandler):
    """A handler that writes to whatever `sys.stderr` is at the moment of each record (not the object it was at
    setup), so a live progress display that redirects stderr (`marin_rl.progress`) prints log lines above itself."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ / setStream assign it; the live stderr wins
        pass


def configure_logging() -> None:
    """Log ours at INFO with a timestamp to stderr (colour codes stripped unless stderr is a terminal); quiet
    third-party loggers (errors only). Leaves a root logger that already has handlers (pytest, an embedding
    program) as it is, apart from the levels."""
    handler = StderrHandler()
    handler.setFormatter(PlainFormatter(color=is_terminal(sys.stderr)))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("levanter.inference.openai").setLevel(logging.CRITICAL)


class DropMessages(logging.Filter):
    """Drops the records whose message starts with one of `prefixes`."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def drop_log_messages(logger_name: str, *prefixes: str) -> None:
    """From now on, logger `logger_name` drops messages starting with one of `prefixes` (once per logger and set)."""
    target = logging.getLogger(logger_name)
    if not any(isinstance(f, DropMessages) and f.prefixes == prefixes for f in target.filters):
        target.addFilter(DropMessages(prefixes))


def plain_ray_output(environ: dict[str, str] | None = None) -> None:
    """Before this driver starts Ray: when its stdout or stderr is not a terminal, Ray prints its actors' lines
    without the colour codes it wraps their `(Actor pid=N)` prefix in (`RAY_COLOR_PREFIX=0`; a value already set
    wins)."""
    environ = os.environ if environ is None else environ
    if not (is_terminal(sys.stdout) and is_terminal(sys.stderr)):
        environ.setdefault("RAY_COLOR_PREFIX", "0")
