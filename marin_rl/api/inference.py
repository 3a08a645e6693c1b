"""`InferenceEngine`: sampling, rollouts and asynchronous batch preparation over the inference servers.

The engine owns a `PolicyClient` and an event loop in a background thread. Workflows are the existing
environments: a group of `group_size` episodes of a problem is `env.run_group(policy, problem, ...)` (single-turn
environments sample it in one request), exactly what the orchestrator's env actors run.

Two kinds of work:

* gated work — `submit`, `prepare_batch`: groups start only as the staleness gate (`marin_rl.api.staleness`)
  allows, with v the version the servers serve (`version`), b the batches `prepare_batch` has returned and B =
  `batch_size × group_size` rollouts per batch. Generation continues in the background between calls (asynchronous
  preparation), at most η = `max_staleness` versions ahead. `prepare_batch` also discards, and counts, a finished
  group with a token older than v − η, so no group it returns lags more than η versions behind the served policy:
  with weights pushed after every train step (`TrainEngine.update_weights`), no trained token lags more than η.
  Every gated group is validated when it finishes (`marin_rl.replay.validation.check_group`, the replay buffers'
  check, against the workflow's name and the vocabulary size when the engine knows it): an invalid one (a token id
  outside the vocabulary, a logprob count that does not match the sampled tokens, a sampled turn without a policy
  version, an inconsistent group...) is never handed out by `wait` or `prepare_batch`; it is logged and counted under
  `rejected/{reason}`, with the reason code a replay buffer would give it, and frees its room in the gate.
* ungated work — `agenerate`, `rollout_batch`, `evaluate` (evaluation, one-off sampling): runs at once, outside
  the gate.

Groups and evaluations are run by a `RolloutWorker` (`marin_rl.api.rollouts`) on the engine's loop, the same code the
orchestrator's env actors run.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from marin_rl.api.rollouts import RolloutWorker
from marin_rl.api.servers import make_policy_server
from marin_rl.api.staleness import GateInputs, StalenessGate
from marin_rl.broadcast.base import WeightSubscriber, WeightUpdate, make_transport
from marin_rl.config import RunConfig
from marin_rl.envs.base import Environment, Problem, SamplingParams
from marin_rl.envs.model_rewards import attach_reward_models
from marin_rl.inference.client import PolicyClient, Sample
from marin_rl.inference.reward_server import RewardClient, RewardServer
from marin_rl.replay.validation import GroupRejected, check_group
from marin_rl.tokenizer import load_tokenizer
from marin_rl.types import RolloutGroup

logger = logging.getLogger(__name__)


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


@dataclass
class GroupResult:
    """A finished gated group (what `wait` and `prepare_batch` return)."""

    group: RolloutGroup
    """The scored rollouts."""
    problem: Problem
    """The problem it was sampled for."""
    started_version: int
    """Version the servers served when the group started."""
    oldest_version: int
    """Oldest policy version among its sampled tokens."""


class InferenceEngine:
    """Sampling and rollouts over inference servers; see the module docstring for the staleness contract.

    Build one with `InferenceEngine.local(run_config)` (embedded Levanter servers in this process) or
    `InferenceEngine.remote(addresses)` (servers already running: embedded, vLLM, or a run's). Thread-safe: methods
    may be called from any thread except the engine's own loop (workflows may await `agenerate` there).
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
        self.vocab_size = vocab_size
        """Vocabulary size gated groups' token ids are validated against (None: only non-negative integers)."""
        self.servers = list(servers or [])
        """In-process servers (`local`), which get weights directly; empty for remote servers."""
        self.reward_servers = list(reward_servers or [])
        """In-process reward servers (`local` with `reward_models`), stopped by `close`."""
        timeout = self.config.request_timeout_s
        self.reward_clients: dict[str, RewardClient] = {
            name: RewardClient(addrs, name=name, timeout_s=timeout) for name, addrs in (reward_addresses or {}).items()
        }
        """A client per reward model (by name); `attach_reward_models` makes them named rewards of an environment."""
        self._env_reward_models = dict(env_reward_models or {})
        self.control_secret = control_secret
        self._transport = transport
        self._subscribers = [WeightSubscriber(transport, s.apply_weights) for s in self.servers] if transport else []
        self._gate = StalenessGate(self.config.max_staleness, self.config.group_size)
        self._cond = threading.Condition()
        self._version = -1
        self._base: int | None = None  # version when the first gated batch was asked for
        self._batches = 0
        self._paused = False
        self._closed = False
        self._pending: collections.deque[tuple[Problem, Environment]] = collections.deque()
        self._source: tuple[Iterator[Problem], Environment] | None = None
        self._source_key: int | None = None
        self._in_flight = 0  # rollouts of gated groups running
        self._done: collections.deque[GroupResult] = collections.deque()
        self._errors: list[BaseException] = []
        self.counters = collections.Counter()
        """Gated groups: started, finished (came back from the workflow), `rejected/{reason}` (finished but invalid:
        validation's reason code), accepted, rejected (by `should_accept`), discarded_stale, failed."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="inference-engine", daemon=True)
        self._thread.start()
        self.worker = RolloutWorker(self.addresses, timeout_s=self.config.request_timeout_s, api_key=api_key)
        """Runs the groups and evaluations (on the engine's loop): the same code as the orchestrator's env actors."""
        self.client: PolicyClient = self._call(self._make_clients())
        """The client of gated groups and `agenerate` (token ids in and out, per-token versions)."""

    async def _make_clients(self) -> PolicyClient:
        self.worker.client("eval")
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
        environment's group size and sampling and `orchestrator.max_staleness`. Blocks until the servers listen
        (compiling the engine, or starting vLLM, takes a while)."""
        tokenizer = tokenizer or load_tokenizer(run_config.tokenizer)
        if config is None:
            env = run_config.envs[0]
            config = EngineConfig(
                group_size=env.group_size,
                sampling=env.sampling,
                max_staleness=run_config.orchestrator.max_staleness,
                request_timeout_s=run_config.inference.request_timeout_s,
            )
        servers, reward_servers, reward_addresses = [], [], {}
        try:
            for i in range(num_servers or run_config.inference.num_servers):
                servers.append(make_policy_server(run_config, tokenizer, f"server-{i}"))
            addresses = [s.start() for s in servers]
            for name in run_config.used_reward_models():
                model = run_config.reward_model(name)
                for i in range(model.num_servers):
                    reward_servers.append(RewardServer.from_checkpoint(model, f"{name}-{i}"))
                    reward_addresses.setdefault(name, []).append(reward_servers[-1].start())
        except BaseException:
            for s in [*servers, *reward_servers]:
                s.stop()
            raise
        return cls(
            addresses,
            config,
            servers=servers,
            transport=make_transport(run_config.broadcast),
            reward_addresses=reward_addresses,
            reward_servers=reward_servers,
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
        """An engine over running servers at `addresses` ('host:port'). Pausing and weight updates use their
        control routes and need `control_secret` (the servers' `inference.control_secret`). `reward_addresses`:
        running reward servers by model name (for `attach_reward_models`). `vocab_size` (e.g. `len(tokenizer)`):
        gated groups' token ids are checked against it (None: only for being non-negative integers). `api_key`:
        the servers' `inference.api_key`, sent with every completions request."""
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
        KeyError naming a model this engine has no servers for."""
        if names is None:
            names = self._env_reward_models.get(workflow.name, [])
        missing = [n for n in names if n not in self.reward_clients]
        if missing:
            raise KeyError(f"no reward servers for {missing}; this engine has {sorted(self.reward_clients)}")
        attach_reward_models(workflow, {n: self.reward_clients[n] for n in names})
        return workflow

    # ---- the event loop -----------------------------------------------------------------------------
    def _call(self, coro, timeout: float | None = None):
        """Run `coro` on the engine's loop and block for its result."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("blocking InferenceEngine calls cannot run on the engine's own event loop")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ---- versions -----------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The policy version the servers serve, as this engine knows it (-1 before any update)."""
        return self._version

    def set_version(self, version: int) -> None:
        """Record that the servers serve `version` (done by `apply_update`; call it when weights reach the servers
        another way). Gated groups may start again as the gate allows. Non-blocking."""
        with self._cond:
            self._version = int(version)
        self._pump()

    def apply_update(self, update: WeightUpdate) -> dict[str, float]:
        """Serve a published weight update on every server and record its version; blocks until every server serves
        it. Local servers fetch it from the transport; remote ones poll their own transport's latest publish
        through `POST /v1/control/weights` (the transport must reach across processes: arrow_flight, fsspec, ray).
        Returns timings; raises RuntimeError when a remote server refuses or serves another version."""
        start = time.time()
        if self.servers:
            results = [s.apply_update(update) for s in self._subscribers]
            apply_s = max(r["apply_s"] for r in results)
        else:
            for address in self.addresses:
                body = self._control(address, "weights")
                if int(body.get("version", -2)) != update.version:
                    raise RuntimeError(
                        f"server {address} serves version {body.get('version')} after the weight "
                        f"update, not {update.version}"
                    )
            apply_s = time.time() - start
        self.set_version(update.version)
        return {
            "broadcast/seconds": time.time() - start,
            "broadcast/apply_s": apply_s,
            "broadcast/bytes": update.num_bytes,
        }

    def _control(self, address: str, action: str) -> dict:
        if self.control_secret is None:
            raise RuntimeError(f"{action} on remote servers needs the servers' control_secret")
        r = httpx.post(
            f"http://{address}/v1/control/{action}",
            headers={"Authorization": f"Bearer {self.control_secret}"},
            timeout=self.config.request_timeout_s,
        )
        if r.status_code != 200:
            raise RuntimeError(f"server {address} refused {action}: HTTP {r.status_code} {r.text}")
        return r.json()

    # ---- pause / resume -----------------------------------------------------------------------------
    def pause(self) -> None:
        """Start no new gated group and pause sampling on every server (requests in progress wait). Blocking."""
        with self._cond:
            self._paused = True
        for s in self.servers:
            s.pause()
        if not self.servers:
            for address in self.addresses:
                self._control(address, "pause")

    def resume(self) -> None:
        """Undo `pause`: servers sample again and gated groups start as the gate allows. Blocking."""
        for s in self.servers:
            s.resume()
        if not self.servers:
            for address in self.addresses:
                self._control(address, "resume")
        with self._cond:
            self._paused = False
        self._pump()

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
        if _running_loop() is self._loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

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
        size = group_size or self.config.group_size
        params = sampling or self.config.sampling
        problems = list(problems)
        return self._call(
            self.worker.run_groups(workflow, problems, size, params, max_concurrent=max_concurrent, role="eval")
        )

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
        return self._call(
            self.worker.evaluate(
                workflow,
                problems,
                samples_per_problem,
                sampling or self.config.sampling,
                seed=seed,
                max_concurrent=max_concurrent,
            )
        )

    # ---- gated work ---------------------------------------------------------------------------------
    def submit(self, problem: Problem, workflow: Environment) -> None:
        """Queue one group of `problem` through `workflow`; it starts when the staleness gate allows. Non-blocking;
        collect it with `wait`."""
        with self._cond:
            self._check_gated_work_can_start()
            self._pending.append((problem, workflow))
        self._pump()

    def wait(self, count: int, timeout: float | None = None) -> list[GroupResult]:
        """Block until `count` gated groups have finished and return them (first finished first). Groups that failed
        validation are not returned (they are counted under `counters['rejected/{reason}']`). Raises TimeoutError
        after `timeout` seconds (the finished ones stay for the next call) and re-raises the error of a failed
        episode."""
        deadline = None if timeout is None else time.time() + timeout
        with self._cond:
            while True:
                self._raise_errors()
                if len(self._done) >= count:
                    return [self._done.popleft() for _ in range(count)]
                left = None if deadline is None else deadline - time.time()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"{len(self._done)} of {count} groups finished within {timeout}s "
                        f"({self._in_flight} rollouts in flight)"
                    )
                self._cond.wait(0.5 if left is None else min(left, 0.5))

    def prepare_batch(
        self,
        dataloader: Iterable[Problem],
        workflow: Environment,
        should_accept: Callable[[RolloutGroup], bool] | None = None,
        timeout: float | None = None,
    ) -> list[RolloutGroup]:
        """Block until `config.batch_size` groups have passed `should_accept` and return them (first finished
        first), while groups of problems drawn from `dataloader` keep starting, in the background and between
        calls, as the staleness gate allows. Passing the same iterable again continues it; another one replaces it.
        Each call counts as one batch formed (b in the gate). A finished group with a token older than
        `version − max_staleness` is discarded and counted (`counters['discarded_stale']`); one that failed
        validation never gets here (`counters['rejected/{reason}']`, module docstring). Raises TimeoutError
        after `timeout` seconds, StopIteration when the dataloader is exhausted before the batch is full, and the
        error of a failed episode."""
        accept = should_accept or (lambda group: True)
        with self._cond:
            self._check_gated_work_can_start()
            if self._source_key != id(dataloader):
                self._source = (iter(dataloader), workflow)
                self._source_key = id(dataloader)
            else:
                self._source = (self._source[0], workflow)
            if self._base is None:
                self._base = max(self._version, 0)
            self._wanting = True
        self._pump()
        deadline = None if timeout is None else time.time() + timeout
        out: list[GroupResult] = []
        try:
            while len(out) < self.config.batch_size:
                with self._cond:
                    self._raise_errors()
                    while self._done and len(out) < self.config.batch_size:
                        result = self._done.popleft()
                        if result.oldest_version < self._version - self.config.max_staleness:
                            self.counters["discarded_stale"] += 1
                        elif accept(result.group):
                            self.counters["accepted"] += 1
                            out.append(result)
                            self._held += len(result.group.rollouts)
                        else:
                            self.counters["rejected"] += 1
                    if len(out) >= self.config.batch_size:
                        break
                    if self._source is None and not self._in_flight and not self._pending:
                        raise StopIteration(
                            f"the dataloader ran out with {len(out)} of {self.config.batch_size} groups of the batch"
                        )
                    left = None if deadline is None else deadline - time.time()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"{len(out)} of {self.config.batch_size} groups within {timeout}s")
                    self._cond.wait(0.5 if left is None else min(left, 0.5))
                self._pump()  # rejected or discarded groups freed room
        finally:
            with self._cond:
                self._wanting = False
                self._held = 0
                if len(out) == self.config.batch_size:
                    self._batches += 1
                else:  # not handed out: back to the front of the queue
                    self._done.extendleft(reversed(out))
        self._pump()
        return [r.group for r in out]

    _wanting = False  # a prepare_batch call is waiting (the gate's starvation rule may then start one group)
    _held = 0  # rollouts of the batch a prepare_batch call is filling (buffered, for the gate)

    def _gate_inputs(self) -> GateInputs:
        base = self._base if self._base is not None else max(self._version, 0)
        buffered = self._held + sum(len(r.group.rollouts) for r in self._done)
        per_batch = self.config.batch_size * self.config.group_size
        return GateInputs(
            served_version=max(self._version, base),
            batches_formed=base + self._batches,
            in_flight=self._in_flight,
            buffered=buffered,
            rollouts_per_batch=float(per_batch),
            starved=self._wanting and buffered < per_batch,  # what finished cannot fill the batch being asked for
        )

    def _pump(self) -> None:
        """Start the gated groups the gate allows now (from the queue of `submit`, then the dataloader)."""
        with self._cond:
            if self._paused or self._closed:
                return
            allowed = self._gate.groups_allowed(self._gate_inputs())
            limit = self.config.max_concurrent_groups - self._in_flight // self.config.group_size
            for _ in range(max(0, min(allowed, limit))):
                if self._pending:
                    problem, workflow = self._pending.popleft()
                elif self._source is not None:
                    try:
                        problem = next(self._source[0])
                    except StopIteration:
                        self._source = None
                        break
                    workflow = self._source[1]
                else:
                    break
                self._in_flight += self.config.group_size
                self.counters["started"] += 1
                asyncio.run_coroutine_threadsafe(self._run_group(problem, workflow, self._version), self._loop)

    async def _run_group(self, problem: Problem, workflow: Environment, version: int) -> None:
        rejected: GroupRejected | None = None
        try:
            group = await self.worker.run_group(workflow, problem, self.config.group_size, self.config.sampling)
            try:
                check_group(group, workflow.name, self.vocab_size)  # the replay buffers' validation
            except GroupRejected as e:
                rejected = e
            else:
                oldest = min((r.oldest_version for r in group.rollouts), default=version)
        except BaseException as e:  # noqa: BLE001 - handed to the caller of wait/prepare_batch
            with self._cond:
                self._in_flight -= self.config.group_size
                self.counters["failed"] += 1
                self._errors.append(e)
                self._cond.notify_all()
            return
        if rejected is not None:
            logger.warning(
                "InferenceEngine: rejected a group of %s, problem %s (%s): %s",
                workflow.name,
                problem.id,
                rejected.reason,
                rejected.detail,
            )
        with self._cond:
            self._in_flight -= self.config.group_size  # a rejected group frees its room in the gate
            self.counters["finished"] += 1
            if rejected is not None:
                self.counters[f"rejected/{rejected.reason}"] += 1
            else:
                self._done.append(GroupResult(group, problem, version, oldest))
            self._cond.notify_all()
        self._pump()

    def _raise_errors(self) -> None:
        if self._errors:
            error = self._errors.pop(0)
            raise RuntimeError(f"a group failed: {error!r}") from error

    def _check_gated_work_can_start(self) -> None:
        if self._closed:
            raise RuntimeError("the InferenceEngine is closed")
        if self._version < 0:
            raise RuntimeError(
                "gated work needs the servers to serve a policy version first: call "
                "TrainEngine.update_weights(inference) (or apply_update / set_version) before submit or prepare_batch "
                "(tokens of the initial weights, version -1, carry no policy version and would be rejected)"
            )

    # ---- status and lifecycle -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Version, batches formed, rollouts in flight and finished, the counters (`groups/{counter}`, invalid groups
        under `groups/rejected/{reason}`), and each local server's stats (`reward_servers`: the local reward
        servers')."""
        with self._cond:
            out = {
                "version": self._version,
                "batches": self._batches,
                "in_flight_rollouts": self._in_flight,
                "finished_groups": len(self._done),
                **{f"groups/{k}": v for k, v in self.counters.items()},
            }
        out["servers"] = [s.stats() for s in self.servers]
        if self.reward_servers:
            out["reward_servers"] = [s.stats() for s in self.reward_servers]
        return out

    def close(self) -> None:
        """Stop starting groups, close the client, stop local servers and the loop. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        try:
            self._call(self.worker.aclose(), timeout=30)
            for client in self.reward_clients.values():
                self._call(client.aclose(), timeout=30)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        for s in [*self.servers, *self.reward_servers]:
            s.stop()
        if self._transport is not None:
            self._transport.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
