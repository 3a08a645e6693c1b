"""Logging setup for the driver, the actors and the programs: our loggers at INFO, third-party ones quiet."""

from __future__ import annotations

import logging

QUIET_LOGGERS = ("levanter", "jax", "absl", "httpx", "uvicorn", "openai", "urllib3", "ray", "tqdm_loggable")
"""Third-party loggers that only report errors."""


def configure_logging() -> None:
    """Log ours at INFO with a timestamp; quiet third-party loggers (errors only)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("levanter.inference.openai").setLevel(logging.CRITICAL)
