"""`RunState`: the driver's progress that a checkpoint saves (`run_state.json`) besides the rollout controller's
state: the step, the token totals, the warm start's result and the held-out evaluations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from marin_rl.checkpoint_dirs import checkpoint_step, read_json

RUN_STATE_FILE = "run_state.json"
"""The driver's state in a checkpoint directory (written first, before the learner's)."""

RUN_STATE_FORMAT = 2
"""Version of the driver's checkpoint state (`run_state.json`); format 1 (before the replay buffers handled
too-long rollouts and the per-token names) is still read."""


@dataclass
class RunState:
    """The driver's counters, saved in checkpoints."""

    step: int = 0
    """Learner steps completed (the policy version the learner is at)."""
    generated_tokens: int = 0
    """Tokens the policy sampled in the groups collected."""
    trained_tokens: int = 0
    """Tokens of the batches trained on."""
    warm_start: dict[str, Any] = field(default_factory=dict)
    """The warm start's result (`final_loss`)."""
    eval_start: dict[str, float] = field(default_factory=dict)
    """The held-out evaluation before the first learner step."""
    last_eval: dict[str, float] = field(default_factory=dict)
    """The latest held-out evaluation."""

    def state_dict(self) -> dict[str, Any]:
        """The entries of `run_state.json` this state writes (with the format)."""
        return {
            "format": RUN_STATE_FORMAT,
            "step": self.step,
            "warm_start": self.warm_start,
            "eval_start": self.eval_start,
            "last_eval": self.last_eval,
            "generated_tokens": self.generated_tokens,
            "trained_tokens": self.trained_tokens,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s entries."""
        self.step = int(state["step"])
        self.warm_start = state["warm_start"]
        self.eval_start = state["eval_start"]
        self.last_eval = state["last_eval"]
        self.generated_tokens = int(state["generated_tokens"])
        self.trained_tokens = int(state["trained_tokens"])


def read_run_state(path: str, env_names: list[str]) -> dict[str, Any]:
    """The driver's state of the complete checkpoint at `path`, checked before the learner loads anything: a format
    this code reads, the step of the checkpoint's marker, and the environments `env_names`; ValueError otherwise."""
    state = read_json(path, RUN_STATE_FILE)
    if int(state.get("format", 1)) > RUN_STATE_FORMAT:
        raise ValueError(f"checkpoint {path} was written by a newer marin_rl (run state format {state['format']})")
    step = int(state["step"])
    if step != checkpoint_step(path):
        raise ValueError(f"checkpoint {path}: run state is at step {step}, its marker at {checkpoint_step(path)}")
    if set(state["pools"]) != set(env_names):
        raise ValueError(f"checkpoint {path} has envs {sorted(state['pools'])}, the config {sorted(env_names)}")
    return state
