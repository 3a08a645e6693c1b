"""Ray actors: the learner, the inference servers (either backend) and the environment workers.

Each wraps a plain class that tests use in-process. Rollouts leave env actors as JSON-compatible dicts
(`RolloutGroup.to_dict`), which the replay buffer validates on the way in.
"""

from __future__ import annotations

import traceback

import ray

from marin_rl.api.train import TrainEngine
from marin_rl.broadcast.base import WeightSubscriber, WeightUpdate, make_transport
from marin_rl.config import RunConfig, make_environment
from marin_rl.envs.base import reference_examples
from marin_rl.inference.config import RewardModelConfig
from marin_rl.inference.reward_server import RewardServer
from marin_rl.inference.teacher import TeacherScorer
from marin_rl.learner import distributed
from marin_rl.logs import configure_logging
from marin_rl.orchestrator.learner_methods import LearnerMethods
from marin_rl.rollouts.reward_models import attach_run_reward_models
from marin_rl.rollouts.servers import make_policy_server
from marin_rl.rollouts.worker import GroupOptions, RolloutWorker
from marin_rl.tokenizer import load_tokenizer
from marin_rl.types import PackedBatch


@ray.remote(num_cpus=0)
class LearnerActor(LearnerMethods):
    """One process of the learner: a Ray shell around the API's `TrainEngine`, which owns (its shards of) the
    policy's parameters and optimizer state.

    Built in two calls so that a multi-host learner can agree on a coordinator first: the actor is created, then
    `start(coordinator)` joins the distributed runtime (`learner.hosts` > 1) and builds the `TrainEngine`. Every
    process runs every method in the same order (they are collectives); process 0 publishes weights and writes
    single-copy files. The calls that are the same on the local backend are `LearnerMethods`'.
    """

    def __init__(self, config: RunConfig, process_id: int = 0, num_processes: int = 1):
        configure_logging()
        config.configure_jax()
        self.config = config
        self.process_id = process_id
        self.num_processes = num_processes
        self.engine: TrainEngine | None = None

    def coordinator_address(self) -> str:
        """Where process 0 serves the distributed runtime (this node, a free port)."""
        return distributed.coordinator_address()

    def start(self, coordinator: str | None = None) -> int:
        """Join the distributed runtime (several hosts) and build the train engine; returns its parameter count."""
        distributed.initialize(coordinator, self.num_processes, self.process_id)
        self.engine = TrainEngine(self.config)
        return self.engine.learner.num_params

    def train_step(self, batch: PackedBatch) -> dict[str, float]:
        """One training step on `batch` with the configured loss; returns the `learner/...` metrics."""
        return self.engine.train_batch(batch)

    def publish(self) -> WeightUpdate | None:
        """Publish the current policy as its version (process 0; the others return None)."""
        return self.engine.publish()

    def request_full_publish(self) -> None:
        """With LoRA: the next publish carries the base too (a server was replaced)."""
        self.engine.learner.request_full_publish()

    def close(self) -> None:
        """Release the broadcast transport (shared-memory slots, a Flight server)."""
        if self.engine is not None:
            self.engine.close()


@ray.remote(num_cpus=0)
class ServerActor:
    """An inference server of the configured backend: the embedded Levanter engine, or vLLM (`inference.backend`).

    Both start from the run's initial policy (`config.model`: `init_from_hf` or its seeded random initialisation)
    labelled version -1; weights arrive through `apply_update`. vLLM starts from that policy exported as a Hugging
    Face checkpoint to a private directory (or from `hf_checkpoint` when given).

    Built in two calls, so that the driver can tell a server that waits for a node from one that is starting (vLLM
    takes minutes): the actor is created (placed), then `start()` builds and starts the server.
    """

    def __init__(
        self, config: RunConfig, name: str, control_secret: str | None = None, hf_checkpoint: str | None = None
    ):
        configure_logging()
        config.configure_jax()
        self.config, self.name, self.hf_checkpoint = config, name, hf_checkpoint
        self.control_secret = control_secret or config.inference.control_secret
        self.server = self.transport = self.subscriber = None
        self.address: str | None = None

    def start(self) -> str:
        """Build the server and start serving (once; a second call returns the same address); returns its
        'host:port'."""
        if self.address is None:
            config = self.config
            tokenizer = load_tokenizer(config.tokenizer)
            self.server = make_policy_server(config, tokenizer, self.name, hf_checkpoint=self.hf_checkpoint)
            self.transport = make_transport(config.broadcast)
            self.subscriber = WeightSubscriber(self.transport, self.server.apply_weights)
            self.server.control_secret = self.control_secret
            self.server.weights_source = self.subscriber.poll
            self.address = self.server.start()
        return self.address

    def get_address(self) -> str | None:
        """'host:port' that clients (on any node, when `inference.host` allows) send requests to (None before
        `start`)."""
        return self.address

    def node_id(self) -> str:
        """The Ray node this server runs on."""
        return ray.get_runtime_context().get_node_id()

    def apply_update(self, update: WeightUpdate) -> dict:
        """Fetch and serve `update` (also a lower version than the one served); returns version, bytes, timings."""
        return self.subscriber.apply_update(update)

    def stats(self) -> dict:
        """The server's counters (served version, requests, tokens, ...)."""
        return self.server.stats()

    def stop(self) -> None:
        """Stop the server (and vLLM's processes) and remove the exported checkpoint (nothing before `start`)."""
        if self.server is not None:
            self.server.stop()
        if self.transport is not None:
            self.transport.close()


@ray.remote(num_cpus=0)
class RewardServerActor:
    """A reward server (`marin_rl.inference.reward_server`) of one of the run's `reward_models`, serving its
    checkpoint."""

    def __init__(self, model: RewardModelConfig, name: str):
        configure_logging()
        self.server = RewardServer.from_checkpoint(model, name)
        self.address = self.server.start()

    def get_address(self) -> str:
        """'host:port' that clients send scoring requests to."""
        return self.address

    def stats(self) -> dict:
        """The server's counters."""
        return self.server.stats()

    def stop(self) -> None:
        """Stop serving."""
        self.server.stop()


class EpisodeError(RuntimeError):
    """An episode raised. Carries the original exception as text: some clients' exceptions (the `openai` client's
    connection errors) cannot be rebuilt on the driver, which would then see Ray's `UnserializableException`
    instead of a failed task."""

    @classmethod
    def wrapping(cls, error: BaseException) -> EpisodeError:
        detail = "".join(traceback.format_exception(error)[-3:]).strip()
        return cls(f"{type(error).__name__}: {error}\n{detail}")


@ray.remote(num_cpus=0)
class EnvActor:
    """Runs groups and evaluations of one environment against the inference servers (many groups concurrently): a
    Ray shell around the API's `RolloutWorker`, which does the work."""

    def __init__(
        self,
        config: RunConfig,
        env_index: int,
        replica: int,
        servers: list[str],
        reward_servers: dict[str, list[str]] | None = None,
        teacher_servers: list[str] | None = None,
    ):
        configure_logging()
        self.env_config = config.envs[env_index]
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.env = make_environment(
            self.env_config, self.tokenizer, seed=config.orchestrator.seed, max_seq_len=config.batcher.max_seq_len
        )
        # reward models as named rewards (`reward_servers`: addresses)
        attach_run_reward_models(self.env, config, self.env_config, reward_servers or {})
        self.worker = RolloutWorker(
            servers,
            timeout_s=config.inference.request_timeout_s,
            api_key=config.inference.api_key,
            routed_experts=config.learner.moe.routing_replay,  # the samples carry their routing
        )
        self.eval_seed = config.orchestrator.seed if config.orchestrator.deterministic else None
        self.greedy_baseline = config.algorithm().greedy_baseline  # ReMax: a greedy episode beside each group
        self.teacher = None  # on-policy distillation: the teacher scores every group (the graph's `teacher_inf`)
        if config.algorithm().uses_teacher:
            if not teacher_servers:
                raise ValueError(f"env actor of {self.env_config.name}: the algorithm needs a teacher's servers")
            self.teacher = TeacherScorer(
                teacher_servers,
                timeout_s=config.teacher.request_timeout_s,
                api_key=config.inference.api_key,
                temperature=config.teacher.temperature,
                top_k=config.teacher.top_k,
            )
        cfg = self.env_config
        self.options = GroupOptions(
            cfg.group_size, cfg.sampling, self.greedy_baseline, cfg.overlong_penalty, self.teacher
        )
        self.problems = self.env.train_problems()
        if not self.problems:
            raise ValueError(f"environment {self.env_config.name} has no training problems")

    def set_servers(self, servers: list[str]) -> None:
        """Send new requests to `servers` (a server was replaced); requests in flight finish where they are."""
        self.worker.set_servers(servers)

    def num_problems(self) -> int:
        """Number of training problems (the driver's `ProblemIterator` hands out indices below it)."""
        return len(self.problems)

    async def run_group(self, problem_index: int, seed: int | None = None) -> dict:
        """Sample one group of `group_size` episodes of training problem `problem_index`; returns a `GroupResult`
        as its `to_dict()` (the group as JSON-compatible data, with the client's request counters since the last
        group), which the driver reads back with `GroupResult.from_dict`.

        `seed` (deterministic runs): the policy calls of the group are sampled with seeds derived from it.
        """
        if not 0 <= problem_index < len(self.problems):
            raise IndexError(f"problem index {problem_index} outside the {len(self.problems)} training problems")
        try:
            result = await self.worker.sample_group(self.env, self.problems[problem_index], self.options, seed)
        except Exception as e:
            raise EpisodeError.wrapping(e) from None
        return result.to_dict()

    def warm_start_examples(self) -> list[tuple[list[int], list[int]]]:
        """(prompt_ids, completion_ids + EOS) pairs from the environment's reference completions."""
        return reference_examples(self.env, self.tokenizer)

    async def evaluate(self) -> dict[str, float]:
        """Mean reward, pass@1, pass@k and greedy reward on held-out problems (k = eval_samples_per_problem), as
        `eval/<env>/...` metrics (`RolloutWorker.evaluate`)."""
        cfg = self.env_config
        try:
            metrics = await self.worker.evaluate(
                self.env,
                self.env.eval_problems()[: cfg.num_eval_problems],
                cfg.eval_samples_per_problem,
                cfg.sampling,
                seed=self.eval_seed,
            )
        except Exception as e:
            raise EpisodeError.wrapping(e) from None
        return {f"eval/{cfg.name}/{key}": value for key, value in metrics.items()}
