"""Reward models as named rewards: a `RewardClient` (`marin_rl.inference.reward_server`) turned into an async reward
function, attached to an environment like any named reward.

    env.add_reward_functions({"rm": model_reward_function(RewardClient(["127.0.0.1:8001"], name="rm"))})

The function scores `prompt_ids + completion_ids` (single-turn environments: the prompt and the sampled completion;
multi-turn ones: the rendered prompt and the rest of the episode); the environment weighs it by its `reward_weights`
(`{"correct": 0.0, "rm": 1.0}` trains on the model's reward alone while the verifier's is still recorded). Concurrent
calls (a group's completions) travel in one request.
"""

from __future__ import annotations

from collections.abc import Mapping

from marin_rl.envs.base import Environment
from marin_rl.envs.rewards import RewardFunction
from marin_rl.inference.reward_server import RewardClient


def model_reward_function(client: RewardClient) -> RewardFunction:
    """An async reward function `(prompt, completion, prompt_ids, completion_ids, **fields) -> float`: the reward
    model's score of `prompt_ids + completion_ids` (raises the client's error, e.g. `RewardRequestError` for a
    sequence longer than the model's max_seq_len)."""

    async def reward(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **fields) -> float:
        return await client.score_one(prompt_ids, completion_ids)

    reward.__name__ = f"reward_model_{client.name}"
    reward.__qualname__ = reward.__name__
    return reward


def attach_reward_models(env: Environment, clients: Mapping[str, RewardClient]) -> None:
    """Add each client's model to `env` as a named reward under its key (ValueError for a name already in use)."""
    env.add_reward_functions({name: model_reward_function(client) for name, client in clients.items()})
