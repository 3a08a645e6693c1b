"""`LearnerMethods`: the learner calls the driver makes that are the same on both backends (the Ray `LearnerActor`,
the local backend's `LocalLearner`): the warm start, the Hugging Face export, and the learner's part of a run
checkpoint. Each is a call of the process's `TrainEngine`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from marin_rl.api.train import TrainEngine


class LearnerMethods:
    """Mixed into a backend's learner process, which holds its `TrainEngine` as `engine`."""

    engine: TrainEngine

    def warm_start(self, examples: list[tuple[list[int], list[int]]]) -> dict:
        """Supervised steps on (prompt_ids, completion_ids) pairs; returns the loss curve."""
        return self.engine.warm_start(examples)

    def export_hf(self, path: str) -> str:
        """Save the current policy as a Hugging Face checkpoint (local path or fsspec URL; process 0 writes); returns
        `path`."""
        return self.engine.export_hf(path)

    def save_checkpoint(self, path: str, step: int) -> float:
        """Write the learner's part of the run checkpoint at `path` (a prepared directory of
        `marin_rl.checkpoint_dirs`; its completion marker last); returns seconds."""
        start = time.time()
        self.engine.write_state(path, step)
        return time.time() - start

    def load_checkpoint(self, path: str) -> int:
        """Continue from the complete checkpoint at `path`; returns the restored policy version."""
        return self.engine.load(path)
