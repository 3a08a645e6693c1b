"""`InferenceEngine`: sampling, rollouts and asynchronous batch preparation over the inference servers.

The engine owns a `PolicyClient` and an event loop in a background thread. Workflows are the existing
environments: a group of `group_size` episodes of a problem is `env.run_group(policy, problem, ...)` (single-turn
environments sample it in one request), exactly what the orchestrator's env actors run.

Two kinds of work:

* batches — `prepare_batch`: the run's own rollout pipeline (`marin_rl.rollouts.controller.RolloutController`)
  over one in-process worker pool (`LocalWorkerPool`) and one replay buffer: groups start only as the staleness
  gate allows, at most η = `max_staleness` versions ahead of the served policy, generation continuing in the
  background between calls; every finished group is validated, scored by the configured estimator and admitted
  (or rejected with its reason code) by the replay buffer; the batcher packs the batch and drops rollouts older
  than `replay.max_age`. What a run trains on and what `prepare_batch` returns are decided by the same code.
* ungated work — `agenerate`, `rollout_batch`, `evaluate` (evaluation, one-off sampling): runs at once, outside
  the gate.

Groups and evaluations are run by a `RolloutWorker` (`marin_rl.rollouts.worker`) on the engine's loop, the same code
the orchestrator's env actors run. Weight updates, pause and resume reach the servers through a `ServerControl`
(`marin_rl.rollouts.server_control`).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable
from typing import Any

from marin_rl.api.engine_config import EngineConfig
from marin_rl.broadcast.base import WeightUpdate, make_transport
from marin_rl.config import RunConfig
from marin_rl.envs.base import Environment, Problem, SamplingParams
from marin_rl.inference.client import PolicyClient, Sample
from marin_rl.replay.advantages import get_estimator
from marin_rl.replay.batcher import Batcher, FormedBatch
from marin_rl.replay.buffer import ReplayBuffer
from marin_rl.rollouts.controller import RolloutController
from marin_rl.rollouts.event_loop import BackgroundLoop
from marin_rl.rollouts.local_pool import LocalWorkerPool
from marin_rl.rollouts.reward_models import RewardModels
from marin_rl.rollouts.server_control import ServerControl
from marin_rl.rollouts.servers import start_local_servers
from marin_rl.rollouts.worker import RolloutWorker
from marin_rl.tokenizer import load_tokenizer
from marin_rl.types import RolloutGroup

__all__ = ["EngineConfig", "FormedBatch", "InferenceEngine"]


class InferenceEngine:
    """Sampling and rollouts over inference servers; see the module docstring for the staleness contract.

    Build one with `InferenceEngine.local(run_config)` (embedded Levanter servers in this process) or
    `InferenceEngine.remote(addresses)` (servers already running: embedded, vLLM, or a run's). Thread-safe: methods
    may be called from any thread except the engine's own loop (workflows may await `agenerate` there).

    Over running servers, pausing and weight updates use their control routes and need `control_secret` (the
    servers' `inference.control_secret`); `reward_addresses`: running reward servers by model name (for
    `attach_reward_models`); `vocab_size` (e.g. `len(tokenizer)`): the replay buffer checks token ids against it
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
        self.vocab_size = vocab_size
        self.rollouts: RolloutController | None = None
        """The rollout pipeline of `prepare_batch` (built at its first call, for its workflow)."""
        self._pool: LocalWorkerPool | None = None
        self._lock = threading.RLock()  # the controller is driven from the caller's threads, one at a time
        self._version = -1
        self._base: int | None = None  # version served when the first batch was asked for
        self._batches = 0
        self._started = 0
        self._paused = False
        self._closed = False
        self.client: PolicyClient = self._loop.call(self._clients())
        """The client of `prepare_batch`'s groups and `agenerate` (token ids in and out, per-token versions)."""

    async def _clients(self) -> PolicyClient:
        self.worker.client("eval")  # made on the loop, like the batches' client
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
        return self._version

    def set_version(self, version: int) -> None:
        """Record that the servers serve `version` (done by `apply_update`; call it when weights reach the servers
        another way). Groups of `prepare_batch` may start again as the gate allows."""
        with self._lock:
            self._version = int(version)
            self._launch()

    def apply_update(self, update: WeightUpdate) -> dict[str, float]:
        """Serve a published weight update on every server and record its version; blocks until every server serves
        it (`ServerControl.apply_update`: local servers fetch it from the transport, remote ones through their
        control route). Returns timings; raises RuntimeError when a remote server refuses or serves another
        version."""
        timings = self.control.apply_update(update)
        self.set_version(update.version)
        return timings

    def pause(self) -> None:
        """Start no new group of `prepare_batch` and pause sampling on every server (requests in progress wait).
        Blocking."""
        with self._lock:
            self._paused = True
        self.control.pause()

    def resume(self) -> None:
        """Undo `pause`: servers sample again and groups start as the gate allows. Blocking."""
        self.control.resume()
        with self._lock:
            self._paused = False
            self._launch()

    @property
    def paused(self) -> bool:
        """Whether `pause` is in effect."""
        return self._paused

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

    # ---- batches: the run's rollout pipeline (`marin_rl.rollouts.controller`) ----------------------------------
    def prepare_batch(
        self, workflow: Environment, problems: Iterable[Problem] | None = None, *, timeout: float | None = None
    ) -> FormedBatch:
        """Block until the replay buffer can fill a batch, and return it packed (`FormedBatch`: `.batch` the rows
        `TrainEngine.train_batch` takes, `.placed` the rollouts with their advantages, `.metrics`), while groups of
        `workflow` keep starting in the background, between calls too, as the staleness gate allows. Problems come
        from `problems` (any iterable; passing another one later replaces it) or, by default, from
        `workflow.train_problems()` in a run's seeded order. Each call is one batch formed (b in the gate).

        Everything between a finished group and the batch is a run's: validation (reason codes), the estimator,
        `min_group_size`, the zero-variance filter and dynamic sampling, `max_age`, too-long rollouts, packing
        (`config.replay`, `config.batcher`); rejections are logged and counted (`counters`). Raises RuntimeError
        before any policy version is served, for a second workflow, or with the error of a group whose episode
        raised (its problem is handed out again); TimeoutError after `timeout` seconds; StopIteration when
        `problems` ran out before a batch could be formed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._check_can_start()
            pool = self._pipeline_for(workflow, problems)
            if self._base is None:
                self._base = max(self._version, 0)
        while True:
            with self._lock:
                self._check_can_start()
                self._launch()
                admitted = self.rollouts.admit_finished(self._version)
                if admitted.failures:
                    error = pool.last_error
                    raise RuntimeError(f"a group of {workflow.name} failed: {error!r}") from error
                formed = self.rollouts.try_make_batch(self._version)
                if formed is not None:
                    self._batches += 1
                    self._launch()  # the next batches' groups run while the caller trains on this one
                    return formed
                if pool.exhausted and not pool.busy:
                    raise StopIteration(
                        f"the problems ran out with {len(self.rollouts.buffers[pool.name])} rollouts "
                        "waiting, too few for a batch"
                    )
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    buffered = len(self.rollouts.buffers[pool.name])
                    raise TimeoutError(
                        f"no batch within {timeout}s ({buffered} rollouts waiting, {pool.in_flight_rollouts} in flight)"
                    )
            pool.wait(0.5 if left is None else min(left, 0.5))

    def _pipeline_for(self, workflow: Environment, problems: Iterable[Problem] | None) -> LocalWorkerPool:
        """The worker pool of `workflow` (the controller, its buffer and batcher, built at the first call)."""
        if self.rollouts is None:
            cfg = self.config
            self._pool = LocalWorkerPool(
                workflow,
                self.worker,
                self._loop.loop,
                group_size=cfg.group_size,
                sampling=cfg.sampling,
                tokens_per_batch=cfg.batcher.num_rows * cfg.batcher.max_seq_len,
                concurrency=cfg.max_concurrent_groups,
                greedy_baseline=get_estimator(cfg.replay.advantage_estimator).greedy_baseline,  # e.g. ReMax
                problems=problems,
            )
            buffer = ReplayBuffer(
                workflow.name,
                cfg.replay,
                self.vocab_size,
                rollout_dir=cfg.rollout_dir,
                max_tokens=cfg.batcher.max_seq_len,
                too_long=cfg.batcher.too_long,
            )
            buffers = {workflow.name: buffer}
            self.rollouts = RolloutController(
                {workflow.name: self._pool}, buffers, Batcher(cfg.batcher, buffers), cfg.max_staleness
            )
            return self._pool
        pool = self._pool
        if workflow.name != pool.name:
            raise RuntimeError(
                f"this InferenceEngine forms batches of workflow {pool.name!r}, not {workflow.name!r}: one engine per "
                "workflow (a run config with several envs mixes them by their batch shares)"
            )
        pool.env = workflow
        if problems is not None and getattr(pool.iterator, "origin", None) is not problems:
            if not hasattr(pool.iterator, "replace_source"):
                raise RuntimeError(
                    f"the batches of {pool.name!r} draw from its training problems: pass problems= at the first call "
                    "to draw from an iterable"
                )
            pool.iterator.replace_source(problems)
        return pool

    def _check_can_start(self) -> None:
        if self._closed:
            raise RuntimeError("the InferenceEngine is closed")
        if self._version < 0:
            raise RuntimeError(
                "prepare_batch needs the servers to serve a policy version first: call "
                "TrainEngine.update_weights(inference) (or apply_update / set_version) before it (tokens of the "
                "initial weights, version -1, carry no policy version and would be rejected)"
            )

    def _launch(self) -> None:
        """Start the groups the gate allows now (v: the served version; b: batches formed). Under the lock."""
        if self.rollouts is None or self._paused or self._closed or self._version < 0:
            return
        base = self._base if self._base is not None else max(self._version, 0)
        self._started += self.rollouts.launch(max(self._version, base), base + self._batches)

    @property
    def counters(self) -> collections.Counter:
        """The groups of `prepare_batch`: started, accepted (into the replay buffer), `rejected/{reason}` (with the
        replay buffer's reason code: invalid, too small, zero variance, the estimator's own...), failed (the episode
        raised; handed out again), and rollouts `discarded_stale` (older than `replay.max_age`)."""
        out = collections.Counter()
        with self._lock:
            if self.rollouts is None:
                return out
            buffer = next(iter(self.rollouts.buffers.values()))
            out["started"] = self._started
            out["accepted"] = buffer.accepted_groups
            out["failed"] = self._pool.failed_groups
            out["discarded_stale"] = buffer.discarded_stale
            out.update({f"rejected/{k}": v for k, v in buffer.rejected.items()})
        return out

    # ---- status and lifecycle -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Version, batches formed, rollouts in flight and finished, the counters (`groups/{counter}`, invalid groups
        under `groups/rejected/{reason}`), and each local server's stats (`reward_servers`: the local reward
        servers')."""
        with self._lock:
            out: dict[str, Any] = {"version": self._version, "batches": self._batches}
            if self.rollouts is not None:
                pool = self._pool
                out["in_flight_rollouts"] = pool.in_flight_rollouts
                out["buffered_rollouts"] = len(self.rollouts.buffers[pool.name])
                out["rollouts_per_batch"] = pool.batch_size.value
        out.update({f"groups/{k}": v for k, v in self.counters.items()})
        out["servers"] = [s.stats() for s in self.servers]
        if self.rewards.servers:
            out["reward_servers"] = [s.stats() for s in self.rewards.servers]
        return out

    def close(self) -> None:
        """Stop starting groups, close the client, stop local servers and the loop. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._pool is not None:
                self._pool.drop_in_flight()
            if self.rollouts is not None:
                self.rollouts.flush()
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
