"""The environment API: problems, a verifier, and an async episode function that talks to the policy."""

from __future__ import annotations

import abc
import asyncio
import importlib
import time
from dataclasses import dataclass, field
from typing import Any

from marin_rl.envs.rewards import RewardFunction, check_reward_weights, combine_rewards, evaluate_rewards
from marin_rl.inference.client import PolicyClient, Sample
from marin_rl.types import InferenceMetadata, Rollout, RolloutGroup, Turn


@dataclass
class Problem:
    """One task instance."""

    id: str
    """Stable identifier, unique within the environment."""
    prompt: str
    """Text shown to the policy."""
    answer: str
    """Reference answer used by the verifier (and as the warm-start completion)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Extra, environment-specific data."""


@dataclass
class SamplingParams:
    """How the policy samples in an environment."""

    temperature: float = 1.0
    """Sampling temperature (the learner uses the same one to compute logprobs)."""
    max_tokens: int = 16
    """Limit on generated tokens per policy turn."""


class Environment(abc.ABC):
    """A task: training and held-out problems, and an episode that turns a problem into a scored `Rollout`.

    Subclasses take the tokenizer and their own keyword arguments (from the env's `args` in the config).
    `reward_weights` (a class attribute, or the `reward_weights` argument, which replaces it) combines a turn's
    named rewards into its reward: Σ weight · named reward, names without a weight counting 0.
    """

    name: str = "env"
    reward_weights: dict[str, float] = {"correct": 1.0}

    def __init__(
        self, tokenizer, *, name: str | None = None, seed: int = 0, reward_weights: dict[str, float] | None = None
    ):
        self.tokenizer = tokenizer
        self.seed = seed
        if name is not None:
            self.name = name
        if reward_weights is not None:
            self.reward_weights = dict(reward_weights)
        check_reward_weights(self.reward_weights, where=self.name)

    @abc.abstractmethod
    def train_problems(self) -> list[Problem]:
        """Problems to train on."""

    @abc.abstractmethod
    def eval_problems(self) -> list[Problem]:
        """Held-out problems (disjoint from the training ones)."""

    @abc.abstractmethod
    async def run_episode(self, policy: PolicyClient, problem: Problem, sampling: SamplingParams) -> Rollout:
        """Play one episode of `problem` with `policy` and return the scored rollout."""

    def reference_completion(self, problem: Problem) -> str | None:
        """A correct completion for supervised warm start, or None if the env has none."""
        return None

    async def run_group(
        self, policy: PolicyClient, problem: Problem, group_size: int, sampling: SamplingParams
    ) -> RolloutGroup:
        """`group_size` concurrent episodes of one problem."""
        rollouts = await asyncio.gather(*(self.run_episode(policy, problem, sampling) for _ in range(group_size)))
        return RolloutGroup(environment=self.name, problem_id=problem.id, rollouts=list(rollouts))


class SingleTurnEnvironment(Environment):
    """Prompt → one sampled completion → verifier.

    Subclasses implement the problems and either `score` or `reward_functions` (named rule-based reward functions,
    see `marin_rl.envs.rewards`); the named rewards are combined with `reward_weights` into the turn's reward.
    """

    reward_functions: dict[str, RewardFunction] = {}

    def encode_prompt(self, problem: Problem) -> list[int]:
        """Token ids of the prompt (no special tokens added)."""
        return self.tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]

    def score(self, problem: Problem, completion: str) -> dict[str, float]:
        """Named rewards of a completion; combined with `reward_weights` into the turn's reward.

        Override this, or set `reward_functions` (then `rewards` evaluates those instead).
        """
        raise NotImplementedError(f"{type(self).__name__} must override `score` or set `reward_functions`")

    def rewards(
        self, problem: Problem, prompt_ids: list[int], completion: str, completion_ids: list[int]
    ) -> dict[str, float]:
        """Named rewards of a sampled completion: `reward_functions` if any are set, else `score`."""
        if self.reward_functions:
            check_reward_weights(self.reward_weights, list(self.reward_functions), self.name)
            return evaluate_rewards(
                self.reward_functions,
                problem.prompt,
                completion,
                list(prompt_ids),
                list(completion_ids),
                {"answer": problem.answer, **problem.fields},
            )
        return self.score(problem, completion)

    async def run_episode(self, policy: PolicyClient, problem: Problem, sampling: SamplingParams) -> Rollout:
        [rollout] = await self._sample_rollouts(policy, problem, 1, sampling)
        return rollout

    async def run_group(
        self, policy: PolicyClient, problem: Problem, group_size: int, sampling: SamplingParams
    ) -> RolloutGroup:
        """All `group_size` completions in one request (`n=group_size`)."""
        rollouts = await self._sample_rollouts(policy, problem, group_size, sampling)
        return RolloutGroup(environment=self.name, problem_id=problem.id, rollouts=rollouts)

    async def _sample_rollouts(
        self, policy: PolicyClient, problem: Problem, n: int, sampling: SamplingParams
    ) -> list[Rollout]:
        prompt_ids = self.encode_prompt(problem)
        eos = self.tokenizer.eos_token_id
        samples = await policy.sample(
            prompt_ids,
            n=n,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            stop_token_ids=[eos] if eos is not None else None,
        )
        rollouts = []
        for sample in samples:
            completion = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            rewards = self.rewards(problem, prompt_ids, completion, sample.token_ids)
            reward = combine_rewards(rewards, self.reward_weights)
            turns = [
                Turn(role="user", message=problem.prompt, token_ids=list(prompt_ids)),
                policy_turn(sample, completion, sampling, reward=reward, rewards=rewards),
            ]
            rollouts.append(
                Rollout(environment=self.name, problem_id=problem.id, turns=turns, metadata={"answer": problem.answer})
            )
        return rollouts


def policy_turn(
    sample: Sample, text: str, sampling: SamplingParams, *, reward: float = 0.0, rewards: dict | None = None
) -> Turn:
    """An assistant turn from a policy sample, with its logprobs and inference metadata."""
    return Turn(
        role="assistant",
        message=text,
        token_ids=list(sample.token_ids),
        sampler_logprobs=list(sample.sampler_logprobs),
        reward=float(reward),
        rewards=dict(rewards or {}),
        inference_metadata=InferenceMetadata(
            server=sample.server,
            temperature=sampling.temperature,
            max_tokens=sampling.max_tokens,
            version_start=sample.version_start,
            version_end=sample.version_end,
            token_versions=None if sample.token_versions is None else list(sample.token_versions),
            finish_reason=sample.finish_reason,
            latency_s=sample.latency_s,
        ),
        timestamp=time.time(),
    )


def reference_examples(env: Environment, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt_ids, completion_ids + EOS) of the reference completions of `env`'s training problems, for a
    supervised warm start (problems without one are skipped; environments without `encode_prompt` give none)."""
    encode = getattr(env, "encode_prompt", None)
    if encode is None:
        return []
    eos = tokenizer.eos_token_id
    out = []
    for p in env.train_problems():
        completion = env.reference_completion(p)
        if completion is None:
            continue
        ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        out.append((encode(p), ids + ([eos] if eos is not None else [])))
    return out


async def run_groups(
    env: Environment, servers: list[str], problems: list[Problem], group_size: int, sampling: SamplingParams
) -> list[RolloutGroup]:
    """One group per problem, all concurrently, through a client of their own (closed afterwards)."""
    client = PolicyClient(servers)
    try:
        return list(await asyncio.gather(*(env.run_group(client, p, group_size, sampling) for p in problems)))
    finally:
        await client.aclose()


def load_environment_class(path: str) -> type[Environment]:
    """Resolve 'package.module:ClassName' (or 'package.module.ClassName') to an Environment subclass."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
        cls = getattr(module, attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"environment class {path!r} cannot be imported: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"{path!r} is not an Environment subclass")
    return cls
