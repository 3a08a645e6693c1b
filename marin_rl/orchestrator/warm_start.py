"""`WarmStart`: the supervised warm start on the environments' demonstrations before RL, repeated identically when
a learner that died before the first checkpoint is replaced."""

from __future__ import annotations

import logging
from typing import Any

from marin_rl.config import RunConfig
from marin_rl.orchestrator.backends import Backend

logger = logging.getLogger("marin_rl")


class WarmStart:
    """`learner.warm_start` of the run of `config`, on the demonstrations its components `parts` draw."""

    def __init__(self, config: RunConfig, parts: Backend):
        self.config = config
        self.parts = parts
        self._examples: list | None = None  # kept until the first checkpoint: an environment may draw them at random

    def run(self) -> dict[str, Any]:
        """Warm-start the learner (the same demonstrations again when a learner that died before the first
        checkpoint is replaced); returns the learner's result (`losses`, `seconds`, `cached`), {} when off."""
        if self.config.learner.warm_start.steps <= 0:
            return {}
        if self._examples is None:
            self._examples = self.parts.warm_start_examples()
        examples = self._examples
        logger.info(
            "warm start: %d supervised steps on %d demonstrations", self.config.learner.warm_start.steps, len(examples)
        )
        result = self.parts.learner.run("warm_start", examples)
        if result["losses"] and not result.get("cached"):  # a reused one: the learner's line says so
            logger.info("warm start done in %.1fs, final loss %.4f", result["seconds"], result["losses"][-1])
        return result

    def forget(self) -> None:
        """A checkpoint exists: a replaced learner returns to it, not to the warm start; drop the demonstrations."""
        self._examples = None
