"""The local backend (`orchestrator.backend: local`): a whole run in this process, without Ray.

The learner (`marin_rl.orchestrator.local_backend.learner.LocalLearner`: a `TrainEngine` whose steps run on a
worker thread), a colocated policy server (the embedded Levanter engine sampling from the learner's own parameters:
`LevanterInferenceServer(share_weights=True)`), and every environment's workers (`LocalWorkerPool`s on one event-loop
thread, sampling through `InProcessPolicyClient`: no HTTP, no JSON) live in one process and time-share its devices;
so do an on-policy distillation run's teacher (a second embedded engine serving the teacher's checkpoint, which
scores every group through its own `InProcessPolicyClient` before the group is handed over) and the reward models'
servers (on loopback: the env workers score through their HTTP route, as on Ray). A
new version is handed over by reference: the engine reads the learner's arrays (0 bytes copied where the two layouts
agree; the learner's step never donates the policy), so the process holds one copy of the policy, not a learner's and a
server's.

`LocalBackend` has the surface of the Ray `RayBackend`, so `Orchestrator` drives both with one loop: the same
staleness gate, replay buffers, batcher, checkpoints, resume, metrics, reward plot and deterministic mode. Nothing
here imports Ray.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from marin_rl.config import RunConfig, make_environment
from marin_rl.envs.base import reference_examples
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.inference.local_client import InProcessPolicyClient
from marin_rl.inference.teacher import TeacherScorer
from marin_rl.orchestrator.local_backend.learner import ColocatedUpdate, LocalLearner, process_memory
from marin_rl.orchestrator.local_backend.spmd import CommandStream
from marin_rl.orchestrator.run_metrics import eval_row
from marin_rl.orchestrator.teacher_recipe import ensure_teacher, teacher_run_config
from marin_rl.rollouts.controller import RolloutController, run_rollout_controller
from marin_rl.rollouts.local_pool import LocalWorkerPool
from marin_rl.rollouts.reward_models import attach_run_reward_models
from marin_rl.rollouts.worker import RolloutWorker

logger = logging.getLogger("marin_rl")


def policy_bytes(*models) -> int:
    """Bytes of the distinct device buffers that `models` hold (a buffer two of them share counts once): what the
    process keeps resident for them."""
    seen: dict[tuple, int] = {}
    for model in models:
        for leaf in jax.tree_util.tree_leaves(model):
            if not isinstance(leaf, jax.Array):
                continue
            for shard in leaf.addressable_shards:
                data = shard.data
                key = (str(shard.device), data.unsafe_buffer_pointer())
                seen[key] = int(data.size) * data.dtype.itemsize
    return sum(seen.values())


class ColocatedServers:
    """The one colocated policy server, with the surface of the Ray `ServerPool` the loop reads (`stats`,
    `restarts`, `addresses`)."""

    def __init__(self, server: LevanterInferenceServer, addresses: list[str]):
        self.server = server
        self.addresses = addresses
        """The OpenAI endpoint's address when `orchestrator.local_http` serves one; else empty."""
        self.restarts = 0

    def stats(self) -> dict[str, float]:
        """The engine's counters (`servers/0/...`) and the process's memory (`memory/...`)."""
        out: dict[str, float] = {"servers/restarts": 0.0}
        for key, value in self.server.stats().items():
            if isinstance(value, (bool, int, float)):
                out[f"servers/0/{key}"] = float(value)
        out.update(process_memory())
        return out

    def stop(self) -> None:
        """Stop the engine (and the HTTP endpoint, if any)."""
        self.server.stop()


class LocalBackend:
    """The learner, the colocated policy server, the env workers and the rollout controller of one run, in this
    process (`orchestrator.backend: local`). `section(name)` and `count(**counters)` receive the rollout
    controller's profile timings and counters."""

    learner_errors: tuple[type[BaseException], ...] = ()
    """Nothing is replaced in-run: a learner error ends the run, and rerunning the command resumes it."""

    def __init__(
        self,
        config: RunConfig,
        section: Callable[[str], contextlib.AbstractContextManager],
        count: Callable[..., None],
    ):
        self.config = config
        self.env_names = [e.name for e in config.envs]
        self._section, self._count = section, count
        self.tokenizer = None
        self.learner: LocalLearner | None = None
        self.server: LevanterInferenceServer | None = None
        self.servers: ColocatedServers | None = None
        self.teacher_server: LevanterInferenceServer | None = None
        """On-policy distillation: the engine serving the teacher's checkpoint (never given the student's weights)."""
        self.reward_servers: list = []
        """The reward models' servers (`reward_models`), in this process."""
        self.reward_clients: list = []
        """The environments' clients of those servers (closed with the env workers)."""
        self.pools: dict[str, LocalWorkerPool] = {}
        self.workers: dict[str, RolloutWorker] = {}
        self.rollouts: RolloutController | None = None
        self.vocab_size = 0
        self.broadcast_transport = "colocated"
        self._published: ColocatedUpdate | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self.stream: CommandStream | None = None
        """Several hosts: the device work published to the follower processes
        (`marin_rl.orchestrator.local_backend.spmd`)."""

    # ---- starting and stopping ----------------------------------------------------------------------------------
    def start_backend(self) -> None:
        """Nothing to start: no Ray, one process."""

    def start(self) -> None:
        """Build the learner, the colocated engine on its parameters, the environments and their workers on one
        event-loop thread, the replay buffers, the batcher and the controller."""
        from marin_rl.tokenizer import load_tokenizer

        cfg = self.config
        t = time.time()
        cfg.configure_jax()
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        self.vocab_size = vocab_size = len(self.tokenizer)
        self.learner = LocalLearner(cfg, self.tokenizer)
        self.server = LevanterInferenceServer(
            self.learner.model,
            self.tokenizer,
            cfg.inference,
            name="colocated-0",
            share_weights=True,
            compute_dtype=self.learner.compute_dtype,
        )
        if jax.process_count() > 1:  # several hosts: the followers run the same device work, in the same order
            stream = CommandStream()
            self.learner.stream = self.stream = stream
            self.server.context.engine.call_guard = lambda version, inputs: stream.ordered("generate", version, inputs)
        addresses = [self.server.start()] if cfg.orchestrator.local_http else []
        if addresses:
            logger.info("the colocated engine's OpenAI endpoint: http://%s/v1", addresses[0])
        self.servers = ColocatedServers(self.server, addresses)
        teacher = self._start_teacher() if cfg.algorithm().uses_teacher else None
        reward_addresses = self._start_reward_servers()
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="env-workers", daemon=True)
        self._loop_thread.start()
        budget = cfg.batcher.num_rows * cfg.batcher.max_seq_len
        fractions = cfg.env_fractions()
        greedy = cfg.algorithm().greedy_baseline
        for e in cfg.envs:
            env = make_environment(e, self.tokenizer, seed=cfg.orchestrator.seed, max_seq_len=cfg.batcher.max_seq_len)
            self.reward_clients += attach_run_reward_models(env, cfg, e, reward_addresses).values()
            worker = RolloutWorker(client_factory=self._policy_client)
            self.workers[e.name] = worker
            self.pools[e.name] = LocalWorkerPool(
                env,
                worker,
                self._loop,
                group_size=e.group_size,
                sampling=e.sampling,
                tokens_per_batch=fractions[e.name] * budget,
                concurrency=e.concurrency * e.replicas,
                seed=cfg.orchestrator.seed,
                deterministic=cfg.orchestrator.deterministic,
                greedy_baseline=greedy,
                overlong=e.overlong_penalty,
                pass_rate=cfg.problem_sampling(),
                teacher=teacher,
            )
        self.rollouts = run_rollout_controller(cfg, self.pools, vocab_size, self._section, self._count)
        logger.info(
            "policy: %s parameters; learner and colocated engine in this process on %s (%.1fs)",
            f"{self.learner.engine.learner.num_params:,}",
            jax.devices()[0].platform,
            time.time() - t,
        )

    def _policy_client(self) -> InProcessPolicyClient:
        """An env worker's client of the colocated engine (asking for each sample's routing under routing replay)."""
        return InProcessPolicyClient(self.server, routed_experts=self.config.learner.moe.routing_replay)

    def _start_teacher(self) -> TeacherScorer:
        """The teacher's engine (the embedded server built from `teacher.path`'s checkpoint, as a Ray run's teacher
        server is) and a scorer that every environment's groups go through."""
        from marin_rl.rollouts.servers import make_policy_server

        cfg = self.config
        t = time.time()
        checkpoint = ensure_teacher(cfg)  # `run` made it already when a recipe had to
        self.teacher_server = make_policy_server(teacher_run_config(cfg, checkpoint), self.tokenizer, "teacher-0")
        logger.info("teacher (%s) in this process (%.1fs)", checkpoint, time.time() - t)
        return TeacherScorer(
            client=InProcessPolicyClient(self.teacher_server),
            temperature=cfg.teacher.temperature,
            top_k=cfg.teacher.top_k,
        )

    def _start_reward_servers(self) -> dict[str, list[str]]:
        """The reward models' servers, in this process on loopback (the env workers score through their HTTP route,
        as on Ray); their addresses by model name."""
        from marin_rl.rollouts.servers import start_reward_servers

        t = time.time()
        self.reward_servers, addresses = start_reward_servers(self.config)
        if addresses:
            logger.info("reward servers in this process at %s (%.1fs)", addresses, time.time() - t)
        return addresses

    def start_learner(self, wait: bool) -> None:
        """Not supported: the local learner is not replaced in-run."""
        raise RuntimeError("the local backend does not replace its learner in-run; rerun the command to resume")

    def wait(self, training: list[concurrent.futures.Future] | None, timeout_s: float) -> None:
        """Block until a group or the learner step `training` finishes, at most `timeout_s`."""
        futures = [f for p in self.pools.values() for f in p.inflight]
        if training is not None:
            futures.extend(training)
        if futures:
            concurrent.futures.wait(futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def shutdown(self) -> None:
        """Stop the engine, the env workers' loop and the learner's thread."""
        for pool in self.pools.values():
            pool.drop_in_flight()
        if self._loop is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._close_workers(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(timeout=10)
            self._loop = None
        if self.learner is not None:
            self.learner.kill()
        if self.servers is not None:
            self.servers.stop()
        if self.teacher_server is not None:
            self.teacher_server.stop()
        for server in self.reward_servers:
            server.stop()
        if self.stream is not None:
            self.stream.send("stop")  # the followers stop once they ran everything before

    async def _close_workers(self) -> None:
        await asyncio.gather(*(w.aclose() for w in self.workers.values()), *(c.aclose() for c in self.reward_clients))

    def begin_checkpoint(self, root: str, step: int) -> str:
        """Prepare the checkpoint directory of `step` under `root` (on every process of a multi-host run)."""
        return self.learner.run("begin_checkpoint", root, step)

    # ---- servers and weights ------------------------------------------------------------------------------------
    def check_servers(self) -> None:
        """Nothing to check: the engine lives in this process."""

    def broadcast(self) -> dict[str, float]:
        """Hand the learner's current policy to the engine and wait until it is served."""
        return {**self.publish(), **self.apply_published()}

    def publish(self) -> dict[str, float]:
        """Take the learner's current policy (a reference: nothing is copied); returns `broadcast/publish_s`."""
        t = time.time()
        self._published = self.learner.run("publish")
        return {"broadcast/publish_s": time.time() - t}

    def apply_published(self) -> dict[str, float]:
        """The engine serves the published policy from its next engine call (`serve_model`: arrays whose layout
        differs are resharded on the devices); returns the `broadcast/...` metrics (`bytes`: copied)."""
        update, self._published = self._published, None
        t = time.time()
        result = self.server.serve_model(update.version, update.model)
        return {
            "broadcast/seconds": time.time() - t,
            "broadcast/apply_s": result["apply_s"],
            "broadcast/bytes": result["bytes"],
            "broadcast/policy_bytes": float(policy_bytes(update.model)),
            # the copies of this version the process holds: the learner's and whatever the engine serves it from
            "broadcast/resident_policy_bytes": float(policy_bytes(update.model, self.server.context.model)),
        }

    # ---- what the env workers hold ------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the served policy, every environment at once (`eval/...`, with `eval/mean_reward`)."""
        t = time.time()
        cfg = self.config
        eval_seed = cfg.orchestrator.seed if cfg.orchestrator.deterministic else None

        async def one(e) -> dict[str, float]:
            pool = self.pools[e.name]
            metrics = await self.workers[e.name].evaluate(
                pool.env,
                pool.env.eval_problems()[: e.num_eval_problems],
                e.eval_samples_per_problem,
                e.sampling,
                seed=eval_seed,
            )
            return {f"eval/{e.name}/{key}": value for key, value in metrics.items()}

        async def all_envs() -> list[dict[str, float]]:
            return list(await asyncio.gather(*(one(e) for e in cfg.envs)))

        out: dict[str, float] = {}
        for r in asyncio.run_coroutine_threadsafe(all_envs(), self._loop).result():
            out.update(r)
        return eval_row(out, self.env_names, t)

    def warm_start_examples(self) -> list[Any]:
        """Every environment's demonstrations for the supervised warm start ((prompt ids, completion ids) pairs)."""
        examples: list[Any] = []
        for pool in self.pools.values():
            examples += reference_examples(pool.env, self.tokenizer)
        return examples
