"""`EngineConfig`: how an `InferenceEngine` runs groups (group size, sampling, the gated batch and staleness bound,
concurrency, request timeout)."""

from __future__ import annotations

from dataclasses import dataclass, field

from marin_rl.config import RunConfig
from marin_rl.envs.base import SamplingParams


@dataclass
class EngineConfig:
    """How an `InferenceEngine` runs groups."""

    group_size: int = 8
    """Episodes per problem in a group."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling parameters handed to the workflow (temperature, max_tokens)."""
    batch_size: int = 16
    """Accepted groups `prepare_batch` returns; B = batch_size × group_size rollouts per batch in the gate."""
    max_staleness: int = 1
    """η: gated groups start only while generation runs at most this many versions ahead of the served policy."""
    max_concurrent_groups: int = 256
    """Most gated groups in flight at once (on top of the gate's own bound)."""
    request_timeout_s: float = 600.0
    """Timeout of one request to a server."""

    def __post_init__(self):
        for name in ("group_size", "batch_size", "max_concurrent_groups"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"EngineConfig.max_staleness must be an integer >= 0, got {self.max_staleness!r}")

    @classmethod
    def for_run(cls, run_config: RunConfig) -> EngineConfig:
        """The engine config of a run: its first environment's group size and sampling, `orchestrator.max_staleness`
        and `inference.request_timeout_s` (other fields at their defaults)."""
        env = run_config.envs[0]
        return cls(
            group_size=env.group_size,
            sampling=env.sampling,
            max_staleness=run_config.orchestrator.max_staleness,
            request_timeout_s=run_config.inference.request_timeout_s,
        )
