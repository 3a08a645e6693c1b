"""`RewardModels`: an `InferenceEngine`'s reward-model servers and clients, and attaching them to environments as
named rewards; `attach_run_reward_models`: the same for a run's environment (the Ray env actors and the local
backend's workers)."""

from __future__ import annotations

from marin_rl.config import EnvConfig, RunConfig
from marin_rl.envs.base import Environment
from marin_rl.envs.model_rewards import attach_reward_models
from marin_rl.inference.reward_server import RewardClient


class RewardModels:
    """A client per reward model over its servers' `addresses` (by model name, `timeout_s` per request), the
    in-process reward `servers` to stop with them, and the models each environment lists (`env_reward_models`, by
    environment name: the run config's `reward_models`)."""

    def __init__(
        self,
        addresses: dict[str, list[str]] | None,
        servers: list | None,
        env_reward_models: dict[str, list[str]] | None,
        timeout_s: float,
    ):
        self.clients: dict[str, RewardClient] = {
            name: RewardClient(addrs, name=name, timeout_s=timeout_s) for name, addrs in (addresses or {}).items()
        }
        """A client per reward model (by name)."""
        self.servers = list(servers or [])
        """In-process reward servers, stopped by `stop`."""
        self._env_reward_models = dict(env_reward_models or {})

    def attach(self, workflow: Environment, names: list[str] | None = None) -> Environment:
        """Make the reward models `names` (default: those the run config's environment of the same name lists in its
        `reward_models`) named rewards of `workflow`, weighted by its `reward_weights`; returns `workflow`. Raises
        KeyError naming a model there are no servers for."""
        if names is None:
            names = self._env_reward_models.get(workflow.name, [])
        missing = [n for n in names if n not in self.clients]
        if missing:
            raise KeyError(f"no reward servers for {missing}; this engine has {sorted(self.clients)}")
        attach_reward_models(workflow, {n: self.clients[n] for n in names})
        return workflow

    async def aclose(self) -> None:
        """Close the clients (on the event loop they ran on)."""
        for client in self.clients.values():
            await client.aclose()

    def stop(self) -> None:
        """Stop the in-process reward servers."""
        for s in self.servers:
            s.stop()


def attach_run_reward_models(
    env: Environment, config: RunConfig, env_config: EnvConfig, addresses: dict[str, list[str]]
) -> dict[str, RewardClient]:
    """Make each reward model `env_config.reward_models` names a named reward of `env`, scored by a client over its
    servers' `addresses` (by model name) with the model's `request_timeout_s`; returns the clients (to close)."""
    clients = {}
    for name in env_config.reward_models:
        model = config.reward_model(name)
        clients[name] = RewardClient(addresses[name], name=name, timeout_s=model.request_timeout_s)
    attach_reward_models(env, clients)
    return clients
