"""The rollout pipeline between the inference servers and the learner, shared by both backends and the Python API.

* `controller` — `RolloutController`: per environment the staleness gate, the groups in flight (a `WorkerPool`),
  admission into the replay buffer, and the batcher; `WorkerPool`, the interface a backend's pool implements.
* `staleness` — the staleness gate (`StalenessGate`) and the rollouts-per-batch estimate.
* `local_pool` — `LocalWorkerPool`: groups run in this process (the local backend, `InferenceEngine`); the Ray
  backend's pool is `marin_rl.orchestrator.ray_backend.env_pool.EnvPool`.
* `worker` — `RolloutWorker`: groups and held-out evaluations over policy clients, in the caller's event loop.
* `event_loop` — `BackgroundLoop`, the event loop thread the in-process workers run on.
* `servers`, `server_control`, `reward_models` — the inference and reward servers a process starts, their weight
  updates, pause and resume, and the reward models' clients.
"""
