"""`RolloutWorker`: runs a workflow's groups and held-out evaluations against inference servers, in the caller's loop.

This is marin_rl's one implementation of "sample a group" and "evaluate a policy on held-out problems". An
`InferenceEngine` runs one on its own event-loop thread; each of the orchestrator's env actors runs one in the actor's
event loop. Workflows are environments: a group is `workflow.run_group(policy, problem, group_size, sampling)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from marin_rl.envs.base import Environment, Problem, SamplingParams
from marin_rl.envs.iteration import derived_seed, stream_id
from marin_rl.envs.rewards import OverlongPenalty, add_overlong_penalty, combine_rewards
from marin_rl.inference.client import PolicyClient, SeededPolicy
from marin_rl.inference.local_client import InProcessPolicyClient
from marin_rl.types import RolloutGroup

if TYPE_CHECKING:
    from marin_rl.inference.teacher import TeacherScorer

CLIENT_COUNTERS = ("retried_requests", "requests", "request_s", "backend_s", "queue_s")
"""`PolicyClient` counters a worker reports (`take_counters`): retries over every role, the rest over training's."""

EVAL_SEED_STREAM = 1 << 20
"""Offset of evaluation seeds in a workflow's seed stream (training groups use the problem order's indices)."""


@dataclass(frozen=True)
class GroupOptions:
    """How an environment's training groups are sampled (`RolloutWorker.sample_group`; the arguments of
    `RolloutWorker.run_group` other than the problem and the seed)."""

    group_size: int
    """Episodes per group."""
    sampling: SamplingParams
    """Sampling parameters of the policy's calls."""
    greedy_baseline: bool = False
    """ReMax: a greedy episode runs beside each group; its reward becomes the group's `baseline_reward`."""
    overlong: OverlongPenalty | None = None
    """The environment's soft overlong penalty (`add_overlong_penalty`)."""
    teacher: TeacherScorer | None = None
    """On-policy distillation: scores every group before it is handed over."""


@dataclass
class GroupResult:
    """One sampled group as a worker hands it to the driver, with what its clients counted while it ran.

    In process (`LocalWorkerPool`) `group` is the `RolloutGroup`. Across Ray (`EnvActor.run_group`) the result
    travels as `to_dict()`, JSON-compatible data, and `from_dict` on the driver keeps `group` as the group's dict
    (`RolloutGroup.to_dict()`): rollouts never cross a process as pickled objects. The replay buffer parses and
    validates that dict (`RolloutGroup.from_dict`, then `Rollout.validate`), so a malformed group is rejected there
    with its reason code."""

    group: RolloutGroup | dict[str, Any]
    """The group, or (from another process) its `RolloutGroup.to_dict()`, not yet validated."""
    retried_requests: int = 0
    """Requests sent again to another server while the group ran (`CLIENT_COUNTERS`)."""
    profile: dict[str, float] = field(default_factory=dict)
    """Seconds the group took in the worker (`group_s`) and its clients' other counters (`CLIENT_COUNTERS[1:]`)."""

    @property
    def rollout_tokens(self) -> list[int]:
        """Tokens of each rollout (empty for a group dict too malformed to count: the replay buffer rejects it)."""
        if isinstance(self.group, RolloutGroup):
            return [r.num_tokens for r in self.group.rollouts]
        try:
            return [sum(len(t["token_ids"]) for t in r["turns"]) for r in self.group["rollouts"]]
        except (KeyError, TypeError):
            return []

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible form, to cross a process boundary."""
        group = self.group.to_dict() if isinstance(self.group, RolloutGroup) else self.group
        return {"group": group, "retried_requests": self.retried_requests, "profile": dict(self.profile)}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> GroupResult:
        """Inverse of `to_dict`; the group stays a dict, for the replay buffer to validate."""
        return GroupResult(
            group=d["group"],
            retried_requests=int(d.get("retried_requests", 0)),
            profile={str(k): float(v) for k, v in (d.get("profile") or {}).items()},
        )


def named_reward_means(groups: Sequence[RolloutGroup]) -> dict[str, float]:
    """The mean over every rollout of `groups` of each named reward (a rollout's value: the sum over its turns; 0
    where a rollout lacks it), by name."""
    rollouts = [r for g in groups for r in g.rollouts]
    totals: dict[str, float] = {}
    for r in rollouts:
        for turn in r.turns:
            for name, value in turn.rewards.items():
                totals[name] = totals.get(name, 0.0) + float(value)
    return {name: total / max(len(rollouts), 1) for name, total in sorted(totals.items())}


def verifier_scores(groups: Sequence[RolloutGroup], weights: dict[str, float]) -> np.ndarray:
    """Each rollout's verifier score, (groups, rollouts per group): its named rewards weighted by `weights` (the
    environment's `verifier_weights()`), summed over its turns."""
    return np.array(
        [[sum(combine_rewards(t.rewards, weights) for t in r.turns) for r in g.rollouts] for g in groups], dtype=float
    )


class RolloutWorker:
    """Samples groups and evaluates held-out problems through one `PolicyClient` per role.

    Roles: "train" (groups that will be trained on; its request figures are what `take_counters` reports) and
    "eval" (evaluation and one-off sampling). Clients are created in the running event loop at first use, so a
    worker can be built outside it. Not thread-safe: use it from one event loop.

    `client_factory`: instead of server addresses, a function making each role's client (e.g. an
    `InProcessPolicyClient` over a policy server of this process). `api_key`: what the servers'
    `inference.api_key` asks clients to send (None: nothing).
    """

    def __init__(
        self,
        addresses: Sequence[str] = (),
        *,
        timeout_s: float = 600.0,
        client_factory: Callable[[], PolicyClient | InProcessPolicyClient] | None = None,
        api_key: str | None = None,
        routed_experts: bool = False,
    ):
        if not addresses and client_factory is None:
            raise ValueError("RolloutWorker needs at least one server address (or a client_factory)")
        self.addresses = list(addresses)
        self.timeout_s = timeout_s
        self.client_factory = client_factory
        self.api_key = api_key
        self.routed_experts = routed_experts
        """Its clients ask for each sample's routing (routing replay)."""
        self._clients: dict[str, PolicyClient] = {}
        self._retired: list[PolicyClient] = []  # clients replaced by `set_servers`, closed by `aclose`
        self._old = dict.fromkeys(CLIENT_COUNTERS, 0.0)  # counted by replaced clients
        self._reported = dict.fromkeys(CLIENT_COUNTERS, 0.0)

    def client(self, role: str = "train") -> PolicyClient:
        """The client for `role` ("train" or "eval"), created at first use (call from the worker's event loop)."""
        if role not in ("train", "eval"):
            raise ValueError(f"unknown client role {role!r} (train or eval)")
        if role not in self._clients:
            if self.client_factory is not None:
                self._clients[role] = self.client_factory()
            else:
                self._clients[role] = PolicyClient(
                    self.addresses, timeout_s=self.timeout_s, api_key=self.api_key, routed_experts=self.routed_experts
                )
        return self._clients[role]

    def set_servers(self, addresses: Sequence[str]) -> None:
        """Send new requests to `addresses` (a server was replaced); requests in flight finish where they are."""
        if not addresses:
            raise ValueError("RolloutWorker needs at least one server address")
        self.addresses = list(addresses)
        for key in CLIENT_COUNTERS:
            self._old[key] += self._counted(key)
        self._retired += self._clients.values()
        self._clients = {}

    async def run_group(
        self,
        workflow: Environment,
        problem: Problem,
        group_size: int,
        sampling: SamplingParams,
        *,
        seed: int | None = None,
        role: str = "train",
        greedy_baseline: bool = False,
        overlong: OverlongPenalty | None = None,
        teacher: TeacherScorer | None = None,
    ) -> RolloutGroup:
        """One group of `group_size` episodes of `problem`. `seed`: the group's policy calls carry seeds derived
        from it (`SeededPolicy`), so its samples are a function of the seed and the weights. `greedy_baseline`
        (ReMax): a greedy episode of the problem runs alongside, and its reward becomes the group's
        `baseline_reward`. `overlong`: the soft overlong penalty added to every episode's reward (the greedy one's
        too), `add_overlong_penalty`. `teacher`: scores the finished group's tokens (`TeacherScorer.score_group`).
        Raises what an episode (or the teacher) raises."""
        policy = self.client(role)
        if seed is not None:
            policy = SeededPolicy(policy, seed)
        baseline = None
        if not greedy_baseline:
            group = await workflow.run_group(policy, problem, group_size, sampling)
        else:
            greedy = SamplingParams(temperature=0.0, max_tokens=sampling.max_tokens)
            group, baseline = await asyncio.gather(
                workflow.run_group(policy, problem, group_size, sampling),
                workflow.run_group(self.client(role), problem, 1, greedy),
            )
        if overlong is not None:
            add_overlong_penalty(group, overlong)
            if baseline is not None:
                add_overlong_penalty(baseline, overlong)
        if baseline is not None:
            group.baseline_reward = float(baseline.rollouts[0].reward)
        if teacher is not None:
            await teacher.score_group(group)
        return group

    async def run_groups(
        self,
        workflow: Environment,
        problems: Sequence[Problem],
        group_size: int,
        sampling: SamplingParams,
        *,
        seeds: Sequence[int | None] | None = None,
        max_concurrent: int | None = None,
        role: str = "eval",
    ) -> list[RolloutGroup]:
        """One group per problem, concurrently (at most `max_concurrent` at a time), in the problems' order, through
        `role`'s client; `seeds`: one per problem (None: unseeded), as in `run_group`. Raises an episode's error."""
        if max_concurrent is not None and max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        seeds = list(seeds) if seeds is not None else [None] * len(problems)
        limit = asyncio.Semaphore(max_concurrent) if max_concurrent else contextlib.nullcontext()

        async def one(problem: Problem, seed: int | None) -> RolloutGroup:
            async with limit:
                return await self.run_group(workflow, problem, group_size, sampling, seed=seed, role=role)

        return list(await asyncio.gather(*(one(p, s) for p, s in zip(problems, seeds, strict=True))))

    async def evaluate(
        self,
        workflow: Environment,
        problems: Sequence[Problem],
        samples_per_problem: int,
        sampling: SamplingParams,
        *,
        seed: int | None = None,
        max_concurrent: int | None = None,
    ) -> dict[str, float]:
        """Held-out metrics of the served policy on `problems`: mean reward and pass@1 over `samples_per_problem`
        samples per problem at `sampling`, pass@k (k = samples_per_problem: any sample scored), and the greedy
        completion's reward. `seed`: each problem's samples are seeded from (seed, workflow, problem index), so in a
        deterministic run an evaluation is a function of the weights. Keys: reward, pass@1, pass@k, greedy_reward,
        problems, and `rewards/NAME`: the mean of each named reward over the samples (an episode's value summed over
        its turns), weighted or not.

        A workflow that trains on added rewards (a reward model's) and has a verifier of its own
        (`Environment.verifier_weights`) also gets `verifier_reward` and `verifier_greedy_reward`, its verifier's
        mean score of the same samples (for a 0/1 verifier: the held-out accuracy), and pass@1 / pass@k count the
        samples the verifier scored above 0 (a reward model's score, a probability, is always above 0); `reward` stays
        the reward trained on."""
        if not problems:
            raise ValueError(f"no held-out problems to evaluate {workflow.name} on")
        k = samples_per_problem
        seeds = None
        if seed is not None:
            seeds = [derived_seed(seed, stream_id(workflow.name), EVAL_SEED_STREAM, i) for i in range(len(problems))]
        groups = await self.run_groups(workflow, problems, k, sampling, seeds=seeds, max_concurrent=max_concurrent)
        rewards = np.array([[r.reward for r in g.rollouts] for g in groups])
        greedy = SamplingParams(temperature=0.0, max_tokens=sampling.max_tokens)
        greedy_groups = await self.run_groups(workflow, problems, 1, greedy, seeds=seeds, max_concurrent=max_concurrent)
        greedy_rewards = np.array([g.rollouts[0].reward for g in greedy_groups])
        verifier = workflow.verifier_weights() if workflow.added_rewards else {}
        out: dict[str, float] = {"reward": float(rewards.mean())}
        if verifier:
            scores = verifier_scores(groups, verifier)
            out["verifier_reward"] = float(scores.mean())
            out["verifier_greedy_reward"] = float(verifier_scores(greedy_groups, verifier).mean())
            rewards = scores  # pass@k by the verifier
        return {
            **out,
            "pass@1": float((rewards > 0).mean()),
            f"pass@{k}": float((rewards > 0).any(axis=1).mean()),
            "greedy_reward": float(greedy_rewards.mean()),
            "problems": len(problems),
            **{f"rewards/{name}": value for name, value in named_reward_means(groups).items()},
        }

    def _counted(self, key: str) -> float:
        roles = list(self._clients) if key == "retried_requests" else ["train"]
        return sum(getattr(self._clients[r], key) for r in roles if r in self._clients)

    async def sample_group(
        self, workflow: Environment, problem: Problem, options: GroupOptions, seed: int | None = None
    ) -> GroupResult:
        """`run_group` with `options`, timed, with the clients' counters since the last call (`take_counters`)."""
        start = time.perf_counter()
        group = await self.run_group(
            workflow,
            problem,
            options.group_size,
            options.sampling,
            seed=seed,
            greedy_baseline=options.greedy_baseline,
            overlong=options.overlong,
            teacher=options.teacher,
        )
        counts = self.take_counters()
        profile = {"group_s": time.perf_counter() - start, **{k: float(counts[k]) for k in CLIENT_COUNTERS[1:]}}
        return GroupResult(group, int(counts["retried_requests"]), profile)

    def take_counters(self) -> dict[str, float]:
        """What the clients counted (`CLIENT_COUNTERS`) since the last call. Requests of groups still running are
        reported with a later call, so the totals over all calls are exact."""
        out = {}
        for key in CLIENT_COUNTERS:
            total = self._old[key] + self._counted(key)
            out[key], self._reported[key] = total - self._reported[key], total
        return out

    async def aclose(self) -> None:
        """Close every client (their connection pools)."""
        for client in [*self._clients.values(), *self._retired]:
            await client.aclose()
        self._clients, self._retired = {}, []
