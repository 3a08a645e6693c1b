"""`InferenceEngine`: sampling, rollouts and asynchronous batch preparation over the inference servers.

The engine owns a `PolicyClient` and an event loop in a background thread. Workflows are the existing
environments: a group of `group_size` episodes of a problem is `env.run_group(policy, problem, ...)` (single-turn
environments sample it in one request), exactly what the orchestrator's env actors run.

Two kinds of work:

* gated work — `submit` / `wait`, `prepare_batch`: groups start only as the staleness gate allows, at most η =
  `max_staleness` versions ahead of the served policy, generation continuing in the background between calls; no
  group `prepare_batch` returns lags more than η versions, and every group is validated when it finishes. The
  contract in full, and the code, are `marin_rl.api.gated_rollouts`.
* ungated work — `agenerate`, `rollout_batch`, `evaluate` (evaluation, one-off sampling): runs at once, outside
  the gate.

Groups and evaluations are run by a `RolloutWorker` (`marin_rl.api.rollouts`) on the engine's loop, the same code the
orchestrator's env actors run. Weight updates, pause and resume reach the servers through a `ServerControl`
(`marin_rl.api.server_control`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

from marin_rl.api.engine_config import EngineConfig
from marin_rl.api.event_loop import BackgroundLoop
from marin_rl.api.gated_rollouts import GatedRollouts, GroupResult
from marin_rl.api.reward_models import RewardModels
from marin_rl.api.rollouts import RolloutWorker
from marin_rl.api.server_control import ServerControl
from marin_rl.api.servers import start_local_servers
from marin_rl.broadcast.base import WeightUpdate, make_transport
from marin_rl.config import RunConfig
from marin_rl.envs.base import Environment, Problem, SamplingParams
from marin_rl.inference.client import PolicyClient, Sample
from marin_rl.tokenizer import load_tokenizer
from marin_rl.types import RolloutGroup

__all__ = ["EngineConfig", "GroupResult", "InferenceEngine"]


class InferenceEngine:
    """Sampling and rollouts over inference servers; see the module docstring for the staleness contract.

    Build one with `InferenceEngine.local(run_config)` (embedded Levanter servers in this process) or
    `InferenceEngine.remote(addresses)` (servers already running: embedded, vLLM, or a run's). Thread-safe: methods
    may be called from any thread except the engine's own loop (workflows may await `agenerate` there).

    Over running servers, pausing and weight updates use their control routes and need `control_secret` (the
    servers' `inference.control_secret`); `reward_addresses`: running reward servers by model name (for
    `attach_reward_models`); `vocab_size` (e.g. `len(tokenizer)`): gated groups' token ids are checked against it
    (None: only for being non-negative integers); `api_key`: the servers' `inference.api_key`, sent with every
    request. `servers`, `transport`, `reward_servers`, `env_reward_models` are what `local` passes.
    """

    def __init__(
        self,
        addresses: list[str],
        config: EngineConfig | None = None,
        *,
        servers: list | None = None,
        transport=None,
        control_secret: str | None = None,
        reward_addresses: dict[str, list[str]] | None = None,
        reward_servers: list | None = None,
        env_reward_models: dict[str, list[str]] | None = None,
        vocab_size: int | None = None,
        api_key: str | None = None,
    ):
        if not addresses:
            raise ValueError("InferenceEngine needs at least one server address")
        self.config = config or EngineConfig()
        self.addresses = list(addresses)
        self.servers = list(servers or [])
        """In-process servers (`local`), which get weights directly; empty for remote servers."""
        timeout = self.config.request_timeout_s
        self.rewards = RewardModels(reward_addresses, reward_servers, env_reward_models, timeout)
        """The reward models' clients and in-process servers (`local` with `reward_models`, stopped by `close`)."""
        self.control = ServerControl(self.addresses, self.servers, transport, control_secret, timeout)
        """Weight updates, pause and resume on the servers."""
        self._loop = BackgroundLoop("inference-engine")
        self.worker = RolloutWorker(self.addresses, timeout_s=self.config.request_timeout_s, api_key=api_key)
        """Runs the groups and evaluations (on the engine's loop): the same code as the orchestrator's env actors."""
        self.gated = GatedRollouts(self.worker, self._loop, self.config, vocab_size)
        """The gated work (`submit`, `wait`, `prepare_batch`) under the staleness gate."""
        self.client: PolicyClient = self._loop.call(self._clients())
        """The client of gated groups and `agenerate` (token ids in and out, per-token versions)."""

    async def _clients(self) -> PolicyClient:
        self.worker.client("eval")  # made on the loop, like the gated groups' client
        return self.worker.client("train")

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def local(
        cls,
        run_config: RunConfig,
        config: EngineConfig | None = None,
        *,
        tokenizer=None,
        num_servers: int | None = None,
    ) -> InferenceEngine:
        """Start `inference.num_servers` servers of `inference.backend` in this process (embedded Levanter engines,
        or vLLM processes in the vLLM environment), serving `run_config.model`'s initial weights as version -1, and
        an engine over them. Weights arrive through `apply_update` (the `broadcast` config's transport; use
        'in_process' or 'shared_memory' when the learner is in this process). `config` defaults to the first
        environment's group size and sampling and `orchestrator.max_staleness` (`EngineConfig.for_run`). Blocks until
        the servers listen (compiling the engine, or starting vLLM, takes a while)."""
        tokenizer = tokenizer or load_tokenizer(run_config.tokenizer)
        local = start_local_servers(run_config, tokenizer, num_servers or run_config.inference.num_servers)
        return cls(
            local.addresses,
            config or EngineConfig.for_run(run_config),
            servers=local.servers,
            transport=make_transport(run_config.broadcast),
            reward_addresses=local.reward_addresses,
            reward_servers=local.reward_servers,
            env_reward_models={e.name: list(e.reward_models) for e in run_config.envs},
            vocab_size=len(tokenizer),
            api_key=run_config.inference.api_key,
        )

    @classmethod
    def remote(
        cls,
        addresses: list[str],
        config: EngineConfig | None = None,
        *,
        control_secret: str | None = None,
        reward_addresses: dict[str, list[str]] | None = None,
        vocab_size: int | None = None,
        api_key: str | None = None,
    ) -> InferenceEngine:
        """An engine over running servers at `addresses` ('host:port'); the options as the class describes."""
        return cls(
            addresses,
            config,
            control_secret=control_secret,
            reward_addresses=reward_addresses,
            vocab_size=vocab_size,
            api_key=api_key,
        )

    # ---- reward models ------------------------------------------------------------------------------
    def attach_reward_models(self, workflow: Environment, names: list[str] | None = None) -> Environment:
        """Make the reward models `names` (default: those the run config's environment of the same name lists in its
        `reward_models`) named rewards of `workflow`, weighted by its `reward_weights`; returns `workflow`. Raises
        KeyError naming a model this engine has no servers for (`RewardModels.attach`)."""
        return self.rewards.attach(workflow, names)

    # ---- versions, pause and resume -----------------------------------------------------------------
    @property
    def version(self) -> int:
        """The policy version the servers serve, as this engine knows it (-1 before any update)."""
        return self.gated.version

    def set_version(self, version: int) -> None:
        """Record that the servers serve `version` (done by `apply_update`; call it when weights reach the servers
        another way). Gated groups may start again as the gate allows. Non-blocking."""
        self.gated.set_version(version)

    def apply_update(self, update: WeightUpdate) -> dict[str, float]:
        """Serve a published weight update on every server and record its version; blocks until every server serves
        it (`ServerControl.apply_update`: local servers fetch it from the transport, remote ones through their
        control route). Returns timings; raises RuntimeError when a remote server refuses or serves another
        version."""
        timings = self.control.apply_update(update)
        self.set_version(update.version)
        return timings

    def pause(self) -> None:
        """Start no new gated group and pause sampling on every server (requests in progress wait). Blocking."""
        self.gated.set_paused(True)
        self.control.pause()

    def resume(self) -> None:
        """Undo `pause`: servers sample again and gated groups start as the gate allows. Blocking."""
        self.control.resume()
        self.gated.set_paused(False)

    @property
    def paused(self) -> bool:
        """Whether `pause` is in effect."""
        return self.gated.paused

    # ---- ungated sampling ---------------------------------------------------------------------------
    async def agenerate(
        self,
        prompt_ids: list[int],
        *,
        n: int = 1,
        max_tokens: int | None = None,
        temperature: float | None = None,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
    ) -> list[Sample]:
        """Sample `n` completions of `prompt_ids` (token ids in, token ids, logprobs and per-token versions out).
        A coroutine for any event loop; defaults come from `config.sampling`. Raises what the server answers
        (e.g. `marin_rl.inference.client.ServerError` with status 400 for a prompt longer than the context)."""
        sampling = self.config.sampling
        coro = self.client.sample(
            list(prompt_ids),
            n=n,
            max_tokens=sampling.max_tokens if max_tokens is None else max_tokens,
            temperature=sampling.temperature if temperature is None else temperature,
            stop_token_ids=stop_token_ids,
            seed=seed,
        )
        return await self._loop.run(coro)

    def rollout_batch(
        self,
        problems: Iterable[Problem],
        workflow: Environment,
        *,
        group_size: int | None = None,
        sampling: SamplingParams | None = None,
        max_concurrent: int | None = None,
    ) -> list[RolloutGroup]:
        """One group per problem, outside the staleness gate (e.g. evaluation): all at once, or at most
        `max_concurrent` at a time; blocks until all are done and returns them in the problems' order. A failed
        episode raises its error."""
        size, params = group_size or self.config.group_size, sampling or self.config.sampling
        coro = self.worker.run_groups(
            workflow, list(problems), size, params, max_concurrent=max_concurrent, role="eval"
        )
        return self._loop.call(coro)

    def evaluate(
        self,
        workflow: Environment,
        problems: Iterable[Problem] | None = None,
        *,
        samples_per_problem: int = 4,
        sampling: SamplingParams | None = None,
        seed: int | None = None,
        max_concurrent: int | None = None,
    ) -> dict[str, float]:
        """Held-out metrics of the served policy, outside the staleness gate, exactly as a run's evaluation computes
        them: on `problems` (default: all of `workflow.eval_problems()`), mean reward and pass@1 over
        `samples_per_problem` samples each at `sampling` (default `config.sampling`), pass@k (k =
        samples_per_problem) and the greedy completion's reward. `seed` makes the samples a function of the seed
        and the weights. Blocks; returns {reward, pass@1, pass@k, greedy_reward, problems}; raises ValueError when
        there are no problems and an episode's error."""
        problems = list(workflow.eval_problems() if problems is None else problems)
        params = sampling or self.config.sampling
        coro = self.worker.evaluate(
            workflow, problems, samples_per_problem, params, seed=seed, max_concurrent=max_concurrent
        )
        return self._loop.call(coro)

    # ---- gated work (`marin_rl.api.gated_rollouts`) -------------------------------------------------
    def submit(self, problem: Problem, workflow: Environment) -> None:
        """Queue one group of `problem` through `workflow`; it starts when the staleness gate allows. Non-blocking;
        collect it with `wait` (`GatedRollouts.submit`)."""
        self.gated.submit(problem, workflow)

    def wait(self, count: int, timeout: float | None = None) -> list[GroupResult]:
        """Block until `count` gated groups have finished and return them, first finished first; invalid groups are
        counted, not returned; TimeoutError after `timeout` seconds (`GatedRollouts.wait`)."""
        return self.gated.wait(count, timeout)

    def prepare_batch(
        self,
        dataloader: Iterable[Problem],
        workflow: Environment,
        should_accept: Callable[[RolloutGroup], bool] | None = None,
        timeout: float | None = None,
    ) -> list[RolloutGroup]:
        """Block until `config.batch_size` groups have passed `should_accept` and return them, while groups of
        problems from `dataloader` keep starting in the background as the staleness gate allows; each call is one
        batch formed. Stale groups are discarded, invalid ones never get here; TimeoutError after `timeout`
        seconds, StopIteration when the dataloader runs out (`GatedRollouts.prepare_batch` states the contract)."""
        return self.gated.prepare_batch(dataloader, workflow, should_accept, timeout)

    @property
    def counters(self) -> collections.Counter:
        """Gated groups: started, finished (came back from the workflow), `rejected/{reason}` (finished but invalid:
        validation's reason code), accepted, rejected (by `should_accept`), discarded_stale, failed."""
        return self.gated.counters

    # ---- status and lifecycle -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Version, batches formed, rollouts in flight and finished, the counters (`groups/{counter}`, invalid groups
        under `groups/rejected/{reason}`), and each local server's stats (`reward_servers`: the local reward
        servers')."""
        out = self.gated.stats()
        out["servers"] = [s.stats() for s in self.servers]
        if self.rewards.servers:
            out["reward_servers"] = [s.stats() for s in self.rewards.servers]
        return out

    def close(self) -> None:
        """Stop starting groups, close the client, stop local servers and the loop. Idempotent."""
        if not self.gated.close():
            return
        try:
            self._loop.call(self.worker.aclose(), timeout=30)
            self._loop.call(self.rewards.aclose(), timeout=30)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        for s in self.servers:
            s.stop()
        self.rewards.stop()
        self.control.close()
        self._loop.stop(timeout=30)

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
