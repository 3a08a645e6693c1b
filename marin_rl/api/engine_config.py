"""`EngineConfig`: how an `InferenceEngine` runs groups and forms batches (group size, sampling, the staleness bound,
the replay buffer's estimator and admission rules, the batch's rows, concurrency, request timeout)."""

from __future__ import annotations

from dataclasses import dataclass, field

from marin_rl.config import RunConfig
from marin_rl.envs.base import SamplingParams
from marin_rl.replay.batcher import BatcherConfig
from marin_rl.replay.buffer import ReplayConfig


@dataclass
class EngineConfig:
    """How an `InferenceEngine` runs groups and forms the batches `prepare_batch` returns: with the replay buffer
    and batcher a run uses (`marin_rl.rollouts.controller`)."""

    group_size: int = 8
    """Episodes per problem in a group."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling parameters handed to the workflow (temperature, max_tokens)."""
    max_staleness: int = 1
    """η: groups start only while generation runs at most this many versions ahead of the served policy."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """The replay buffer's rules, as in a run config's `replay:` section: the advantage estimator (any name
    `marin_rl.replay.advantages.register_estimator` registered; a custom admission rule is an estimator that
    rejects), `min_group_size`, the zero-variance filter and dynamic sampling, and `max_age`, the hard bound on the
    lag of every trained token (>= `max_staleness`)."""
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    """The batch `prepare_batch` forms, as in a run config's `batcher:` section: `total_token_budget` over rows of
    `max_seq_len` tokens, `min_fill`, `too_long`."""
    rollout_dir: str | None = None
    """Persist every accepted rollout as Parquet here (local path or fsspec URL), as a run's `rollouts/<env>`;
    None: not persisted."""
    max_concurrent_groups: int = 256
    """Most groups in flight at once (on top of the gate's own bound)."""
    request_timeout_s: float = 600.0
    """Timeout of one request to a server."""

    def __post_init__(self):
        for name in ("group_size", "max_concurrent_groups"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"EngineConfig.max_staleness must be an integer >= 0, got {self.max_staleness!r}")
        self.replay.check_fits(
            max_staleness=("EngineConfig.max_staleness", self.max_staleness),
            group_sizes={"EngineConfig.group_size": self.group_size},
            prefix="EngineConfig.replay",
        )

    @classmethod
    def for_run(cls, run_config: RunConfig) -> EngineConfig:
        """The engine config of a run: its first environment's group size and sampling, `orchestrator.max_staleness`,
        its `replay` and `batcher` sections and `inference.request_timeout_s` (other fields at their defaults)."""
        env = run_config.envs[0]
        return cls(
            group_size=env.group_size,
            sampling=env.sampling,
            max_staleness=run_config.orchestrator.max_staleness,
            replay=run_config.replay,
            batcher=run_config.batcher,
            request_timeout_s=run_config.inference.request_timeout_s,
        )
