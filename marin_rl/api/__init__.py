"""The public Python API: write your own RL loop over the same parts the orchestrator uses.

* `InferenceEngine` — sampling (`agenerate`), batches (`prepare_batch`: the run's rollout pipeline, under the
  staleness bound, scored and packed by the replay buffer and batcher a run uses), ungated rollouts (`rollout_batch`,
  `evaluate`), `pause` / `resume`, versions (`version`, `apply_update`).
* `TrainEngine` — the Levanter learner: `train_batch(batch, loss_fn=..., loss_weight_fn=...)`, `forward`,
  `publish` / `update_weights`, `save` / `load`, `export_hf`, `warm_start`.
* `RolloutWorker` — groups and held-out evaluations in the caller's event loop (what `InferenceEngine` and the
  orchestrator's env actors both run).
* Losses — `register_loss(name)(fn)` for any pure JAX `fn(logprobs, entropy, batch) -> (loss, metrics)`; the
  built-in objectives ('decoupled', 'ppo') are registered the same way. `sequence_means`, `aggregate`, `num_sequences`
  and `proximal_logprobs` help write sequence-level objectives.
* `make_batch` — groups (e.g. from `rollout_batch`) to a packed, token-exact batch with advantages from any
  function of the rewards.
* Estimators — `register_estimator(name)(fn)` for any `fn(group, state) -> GroupScores`: one advantage per rollout
  (or per token), or a rejection reason; `EngineConfig.replay.advantage_estimator` names it.
* Workflows are environments (`marin_rl.envs`): a group is `env.run_group(policy, problem, group_size, sampling)`.

The orchestrator runs on these parts: its learner processes are `TrainEngine`s, its env actors run `RolloutWorker`s,
and its `RolloutController` (`marin_rl.rollouts`) is the one `prepare_batch` drives.

The README's "Python API" section states each call's contract.
"""

from marin_rl.api.inference import EngineConfig, FormedBatch, InferenceEngine
from marin_rl.api.train import TrainEngine, make_batch
from marin_rl.learner.loss_registry import LossSpec, get_loss, known_losses, register_loss
from marin_rl.learner.losses import aggregate, num_sequences, proximal_logprobs, sequence_means
from marin_rl.replay.advantages import GroupScores, register_estimator
from marin_rl.rollouts.staleness import GateInputs, StalenessGate
from marin_rl.rollouts.worker import RolloutWorker

__all__ = [
    "EngineConfig",
    "GateInputs",
    "FormedBatch",
    "GroupScores",
    "InferenceEngine",
    "LossSpec",
    "RolloutWorker",
    "StalenessGate",
    "TrainEngine",
    "aggregate",
    "get_loss",
    "known_losses",
    "make_batch",
    "num_sequences",
    "proximal_logprobs",
    "register_estimator",
    "register_loss",
    "sequence_means",
]
