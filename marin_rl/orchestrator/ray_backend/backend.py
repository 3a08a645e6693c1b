"""The actors of one run on Ray and their lifetimes: Ray itself, the placement's reservations, the learner's
processes, the inference and reward servers, the env actors, and the rollout controller over them; the weight
updates (publish, then every server applies) and the held-out evaluation they run together.

`Orchestrator` (the loop) drives these; everything here is about starting, reaching, replacing and stopping actors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from marin_rl.checkpoint_dirs import begin_checkpoint
from marin_rl.config import RunConfig
from marin_rl.logs import drop_log_messages, plain_ray_output
from marin_rl.orchestrator.ray_backend.env_pool import EnvPool
from marin_rl.orchestrator.ray_backend.launcher import Launcher
from marin_rl.orchestrator.ray_backend.learner_group import LearnerGroup
from marin_rl.orchestrator.ray_backend.reward_pool import RewardServerPool
from marin_rl.orchestrator.ray_backend.server_pool import ServerPool
from marin_rl.orchestrator.ray_backend.teacher_pool import TeacherServerPool
from marin_rl.orchestrator.ray_backend.watchdog import Watchdog, sweep_orphans
from marin_rl.orchestrator.run_metrics import eval_row
from marin_rl.orchestrator.teacher_recipe import ensure_teacher
from marin_rl.placement import wait_for_actors
from marin_rl.rollouts.controller import RolloutController, run_rollout_controller
from marin_rl.tokenizer import load_tokenizer

logger = logging.getLogger("marin_rl")

RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
"""The Ray logger that announces token authentication at every local start."""


class RayBackend:
    """Ray, the learner group, the servers, the env pools and the `RolloutController` of one run.

    `section(name)` and `count(**counters)` receive the rollout controller's profile timings and counters."""

    def __init__(
        self,
        config: RunConfig,
        section: Callable[[str], contextlib.AbstractContextManager],
        count: Callable[..., None],
    ):
        if config.broadcast.secret is None:  # the learner's weight server (arrow_flight) admits this run only
            config = dataclasses.replace(
                config, broadcast=dataclasses.replace(config.broadcast, secret=secrets.token_hex(32))
            )
        self.config = config
        """The run's config, as its actors get it (with the run's `broadcast.secret`)."""
        self.env_names = [e.name for e in config.envs]
        self.control_secret = config.inference.control_secret or secrets.token_urlsafe(24)
        self._section, self._count = section, count
        self._watchdog: Watchdog | None = None
        self._started_ray = False
        self.launcher: Launcher | None = None
        self.learner: LearnerGroup | None = None
        self.servers: ServerPool | None = None
        self.reward_servers: RewardServerPool | None = None
        self.teacher_servers: TeacherServerPool | None = None
        self.pools: dict[str, EnvPool] = {}
        self.rollouts: RolloutController | None = None
        """The rollout pipeline: gates, groups in flight, admission into the replay buffers, the batcher."""
        self.vocab_size = 0
        self.broadcast_transport: str | None = None  # what weights travel through ('auto' decides at the first)
        self._published = None  # an update the learner published, until every server applied it

    learner_errors = (RayActorError,)
    """What a dead learner process raises (the loop replaces the learner and rolls back)."""

    # ---- starting and stopping ----------------------------------------------------------------------------------
    def start_backend(self) -> None:
        """Start (or join) Ray."""
        self.start_ray()

    def wait(self, training: list[ray.ObjectRef] | None, timeout_s: float) -> None:
        """Block until a group or the learner step `training` finishes, at most `timeout_s`."""
        refs = [r for p in self.pools.values() for r in p.wait_refs()]
        if training is not None:
            refs.extend(training)
        if refs:
            ray.wait(refs, num_returns=1, timeout=timeout_s)

    def start_ray(self) -> None:
        """Join `orchestrator.ray_address`, or start a local Ray that dies with this process (unless one runs)."""
        cfg = self.config.orchestrator
        if ray.is_initialized():
            return
        sweep_orphans()  # processes and weight slots that a crashed run on this machine left
        plain_ray_output()  # no colour codes around actor lines written to a file
        if cfg.ray_address:
            ray.init(address=cfg.ray_address, log_to_driver=True)
        else:
            # every process of this local Ray dies with the driver, even when the driver is SIGKILLed
            self._watchdog = Watchdog()
            self._watchdog.start()
            if "RAY_AUTH_MODE" not in os.environ:
                # Ray turns token authentication on for a new local cluster and warns about it, several lines long,
                # at every start; the same said once, briefly (RAY_AUTH_MODE must be set before Ray is imported).
                drop_log_messages(RAY_AUTH_LOGGER, "Token authentication is enabled")
                logger.info("Ray: local cluster with token authentication (Ray's default; RAY_AUTH_MODE=disabled: off)")
            # address="local": a new single-node Ray, even if the machine already runs (or ran) a cluster
            ray.init(
                address="local",
                num_cpus=cfg.num_cpus,
                include_dashboard=False,
                log_to_driver=True,
                logging_level=logging.WARNING,
            )
        self._started_ray = True

    def start(self) -> None:
        """Check the placement, reserve its groups, start the learner's processes, the servers and the env actors
        (bounded waits that name what is missing), then the replay buffers, the batcher and the controller."""
        cfg = self.config
        self.vocab_size = vocab_size = len(load_tokenizer(cfg.tokenizer))
        t = time.time()
        self.launcher = Launcher(cfg)
        self.launcher.check()
        self.launcher.reserve()
        learner_ready = self.start_learner(wait=False)
        self.servers = ServerPool(cfg, self.launcher, self.control_secret)
        self.reward_servers = RewardServerPool(cfg)  # the reward models' servers (reward_models), if any
        ready = wait_for_actors(
            {
                "learner": [(a, r) for a, r in zip(self.learner.actors, learner_ready, strict=True)],
                "servers": self.servers.ready_calls(),
            },
            {"learner": cfg.placement.learner, "servers": cfg.placement.servers},
            cfg.placement.wait_timeout_s,
            {"servers": self.servers.startup},
        )
        addresses = ready["servers"]
        self.servers.addresses = list(addresses)
        logger.info("inference servers up at %s (%.1fs)", addresses, time.time() - t)
        reward_addresses = self.reward_servers.start()
        teacher_addresses = []
        if cfg.algorithm().uses_teacher:  # on-policy distillation: the teacher's servers (never given new weights)
            self.teacher_servers = TeacherServerPool(cfg, ensure_teacher(cfg))
            teacher_addresses = self.teacher_servers.start()
        budget = cfg.batcher.num_rows * cfg.batcher.max_seq_len
        fractions = cfg.env_fractions()
        self.pools = {
            e.name: EnvPool(
                cfg, i, addresses, fractions[e.name] * budget, self.launcher, reward_addresses, teacher_addresses
            )
            for i, e in enumerate(cfg.envs)
        }
        self.rollouts = run_rollout_controller(cfg, self.pools, vocab_size, self._section, self._count)
        logger.info("policy: %s parameters (learner on %d host(s))", f"{ready['learner'][0]:,}", cfg.learner.hosts)

    def start_learner(self, wait: bool) -> list[ray.ObjectRef]:
        """Start the learner's processes (in the placement's bundles); their ready calls, awaited when `wait`
        (`placement.wait_timeout_s` to be placed, naming a resource lost with its node, and as long again to
        start)."""
        self.learner = LearnerGroup(self.config, self.launcher)
        ready = self.learner.start()
        if wait:
            wait_for_actors(
                {"learner": list(zip(self.learner.actors, ready, strict=True))},
                {"learner": self.config.placement.learner},
                self.config.placement.wait_timeout_s,
            )
        return ready

    def shutdown(self) -> None:
        """Stop servers and kill every actor, release the placement groups; shut Ray down if this run started it."""
        if self.servers is not None:
            self.servers.stop()
        if self.reward_servers is not None:
            self.reward_servers.stop()
        if self.teacher_servers is not None:
            self.teacher_servers.stop()
        if self.learner is not None:
            try:
                ray.get(self.learner.call("close"), timeout=10)  # frees the broadcast's shared memory
            except Exception:
                pass
            self.learner.kill()
        for pool in self.pools.values():
            for actor in pool.actors:
                try:
                    ray.kill(actor)
                except Exception:
                    pass
        if self.launcher is not None:
            self.launcher.release()
        if self._started_ray:
            ray.shutdown()
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None

    def begin_checkpoint(self, root: str, step: int) -> str:
        """Prepare the checkpoint directory of `step` under `root` (the driver's job on Ray); its path."""
        return begin_checkpoint(root, step)

    # ---- servers and weights ------------------------------------------------------------------------------------
    def check_servers(self) -> None:
        """Replace dead servers; env actors then send their requests to the current addresses."""
        if self.servers.check():
            self.servers_moved()

    def servers_moved(self) -> None:
        """A server was replaced: it gets the latest weights if it lacks them, then env actors send their requests
        to the current addresses. With LoRA, a replacement that knows no base gets base and adapters again; one that
        could not fetch the latest update (the learner that published it died) gets the learner's next publish. When
        the learner is dead, that publish raises its death, which the loop's recovery handles (its broadcast brings
        every server the restored weights)."""
        base, weights = self.servers.needs_base, self.servers.needs_weights
        self.servers.needs_base = self.servers.needs_weights = False
        try:
            if base:
                self.learner.run("request_full_publish")
            if base or weights:
                self.publish()
                self.apply_published(again=False)
                if self.servers.needs_weights:  # a learner that is alive published, and a server cannot fetch it
                    raise RuntimeError(
                        "an inference server cannot fetch the weights the learner has just published (see the "
                        "warning above); check broadcast.transport for this placement"
                    )
        finally:
            for pool in self.pools.values():
                pool.set_servers(self.servers.addresses)

    def broadcast(self) -> dict[str, float]:
        """Publish the learner's weights and wait until every server serves them."""
        return {**self.publish(), **self.apply_published()}

    def publish(self) -> dict[str, float]:
        """The learner publishes its current weights (the update, a handle whose arrays travel through the
        transport, waits for `apply_published`); returns `broadcast/publish_s`."""
        t = time.time()
        update = self.learner.run("publish")
        if update.transport != self.broadcast_transport:
            logger.info(
                "weights travel through broadcast transport %r (%.1f MB per version)",
                update.transport,
                update.num_bytes / 1e6,
            )
            self.broadcast_transport = update.transport
        self._published = update
        return {"broadcast/publish_s": time.time() - t}

    def apply_published(self, again: bool = True) -> dict[str, float]:
        """Every server applies the update `publish` made (a replaced server gets it too); returns the
        `broadcast/...` metrics (`seconds`: the driver's wait for the servers). A server that could not fetch it
        (the learner died after publishing) gets the learner's next publish (`servers_moved`; not `again`)."""
        update, self._published = self._published, None
        t = time.time()
        restarts = self.servers.restarts
        results = self.servers.broadcast(update)
        if self.servers.restarts != restarts or (again and self.servers.needs_weights):
            self.servers_moved()
        # none from a LoRA replacement waiting for the base, or from a server that could not fetch the update
        results = [r for r in results if "apply_s" in r]
        return {
            "broadcast/seconds": time.time() - t,
            "broadcast/apply_s": max((r["apply_s"] for r in results), default=0.0),
            "broadcast/bytes": results[0]["bytes"] if results else 0.0,
        }

    # ---- what the env actors hold -------------------------------------------------------------------------------
    def evaluate(self, attempts: int = 3) -> dict[str, float]:
        """Held-out metrics of the served policy, every environment's first env actor at once (`eval/...`, with
        `eval/mean_reward` over environments); evaluated again after a server or env actor dies mid-way."""
        t = time.time()
        out: dict[str, float] = {}
        for attempt in range(attempts):
            refs = [pool.actors[0].evaluate.remote() for pool in self.pools.values()]
            try:
                for r in ray.get(refs):
                    out.update(r)
                break
            except (RayTaskError, RayActorError) as e:  # a server (or the env actor) went away mid-evaluation
                if attempt == attempts - 1:
                    raise
                logger.error("evaluation failed (%s); checking the servers and evaluating again", type(e).__name__)
                for pool in self.pools.values():
                    pool.check_actor(0)
                self.check_servers()
        return eval_row(out, self.env_names, t)

    def warm_start_examples(self) -> list[Any]:
        """Every environment's demonstrations for the supervised warm start ((prompt ids, completion ids) pairs)."""
        examples: list[Any] = []
        for pool in self.pools.values():
            examples += ray.get(pool.actors[0].warm_start_examples.remote())
        return examples
