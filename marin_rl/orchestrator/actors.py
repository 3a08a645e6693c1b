"""Ray actors: the learner, the inference servers (either backend) and the environment workers.

Each wraps a plain class that tests use in-process. Rollouts leave env actors as JSON-compatible dicts
(`RolloutGroup.to_dict`), which the replay buffer validates on the way in.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import traceback

import numpy as np
import ray

from marin_rl.broadcast.base import WeightSubscriber, WeightUpdate, make_transport
from marin_rl.config import RunConfig, make_environment
from marin_rl.envs.base import SamplingParams, reference_examples
from marin_rl.envs.iteration import derived_seed, stream_id
from marin_rl.inference.client import PolicyClient, SeededPolicy
from marin_rl.learner import distributed
from marin_rl.learner.checkpoint import load_learner_state, save_learner_state
from marin_rl.learner.learner import Learner
from marin_rl.logs import configure_logging
from marin_rl.model.build import build_model, with_seq_len
from marin_rl.model.hf import export_hf_checkpoint
from marin_rl.tokenizer import load_tokenizer
from marin_rl.types import PackedBatch

CLIENT_COUNTERS = ("retried_requests", "requests", "request_s", "backend_s", "queue_s")
"""`PolicyClient` counters that env actors report with each group."""


@ray.remote(num_cpus=0)
class LearnerActor:
    """One process of the learner: owns (its shards of) the policy's parameters and optimizer state.

    Built in two calls so that a multi-host learner can agree on a coordinator first: the actor is created, then
    `start(coordinator)` joins the distributed runtime (`learner.hosts` > 1) and builds the `Learner`. Every process
    runs every method in the same order (they are collectives); process 0 publishes weights and writes single-copy
    files.
    """

    def __init__(self, config: RunConfig, vocab_size: int, process_id: int = 0, num_processes: int = 1):
        configure_logging()
        self.config = config
        self.vocab_size = vocab_size
        self.process_id = process_id
        self.num_processes = num_processes
        self.learner: Learner | None = None
        self.transport = None

    def coordinator_address(self) -> str:
        """Where process 0 serves the distributed runtime (this node, a free port)."""
        return distributed.coordinator_address()

    def start(self, coordinator: str | None = None) -> int:
        """Join the distributed runtime (several hosts) and build the learner; returns its parameter count."""
        distributed.initialize(coordinator, self.num_processes, self.process_id)
        config = self.config
        self.learner = Learner(
            config.model, config.learner, self.vocab_size, temperature=config.envs[0].sampling.temperature
        )
        if distributed.is_primary():
            self.transport = make_transport(config.broadcast)
        self.tokenizer = load_tokenizer(config.tokenizer)
        return self.learner.num_params

    def warm_start(self, examples: list[tuple[list[int], list[int]]]) -> dict:
        return self.learner.warm_start(examples, self.config.batcher.max_seq_len, seed=self.config.orchestrator.seed)

    def train_step(self, batch: PackedBatch) -> dict[str, float]:
        return self.learner.train_step(batch)

    def publish(self) -> WeightUpdate | None:
        """Publish the current policy as its version (process 0; the others return None). One process publishes the
        model's device arrays (cast on the device when `broadcast.dtype` asks); several gather them first."""
        if self.num_processes == 1:
            return self.transport.publish(self.learner.version, self.learner.model)
        leaves = self.learner.weights()  # a collective: every process takes part
        return self.transport.publish(self.learner.version, leaves) if self.transport is not None else None

    def close(self) -> None:
        """Release the broadcast transport (shared-memory slots, a Flight server)."""
        if self.transport is not None:
            self.transport.close()

    def export_hf(self, path: str) -> str:
        """Save the current policy as a Hugging Face checkpoint (local path or fsspec URL; process 0 writes)."""
        self.learner.export_hf(path, self.tokenizer)
        return path

    def save_checkpoint(self, path: str, step: int) -> float:
        """Write the learner's part of the run checkpoint at `path` (its completion marker last); returns seconds."""
        start = time.time()
        save_learner_state(self.learner, path, step)
        return time.time() - start

    def load_checkpoint(self, path: str) -> int:
        """Continue from the complete checkpoint at `path`; returns the restored policy version."""
        load_learner_state(self.learner, path)
        return self.learner.version


@ray.remote(num_cpus=0)
class ServerActor:
    """An inference server of the configured backend: the embedded Levanter engine, or vLLM (`inference.backend`).

    Both start from the run's initial policy (`config.model`: `init_from_hf` or its seeded random initialisation)
    labelled version -1; weights arrive through `apply_update`. vLLM starts from that policy exported as a Hugging
    Face checkpoint to a private directory (or from `hf_checkpoint` when given).
    """

    def __init__(
        self, config: RunConfig, name: str, control_secret: str | None = None, hf_checkpoint: str | None = None
    ):
        configure_logging()
        self.tokenizer = load_tokenizer(config.tokenizer)
        self._export_dir: str | None = None
        if config.inference.backend == "vllm":
            from marin_rl.inference.vllm_server import VllmPolicyServer

            model = build_model(with_seq_len(config.model, config.inference.max_seq_len), len(self.tokenizer))
            if hf_checkpoint is None:
                self._export_dir = tempfile.mkdtemp(prefix=f"marin_rl_{name}_hf_")
                hf_checkpoint = export_hf_checkpoint(model, self.tokenizer, self._export_dir)
            self.server = VllmPolicyServer(model, hf_checkpoint, self.tokenizer, config.inference, name=name)
            del model
        else:
            from marin_rl.inference.levanter_server import LevanterInferenceServer

            model = build_model(config.model, len(self.tokenizer))
            self.server = LevanterInferenceServer(model, self.tokenizer, config.inference, name=name)
        self.transport = make_transport(config.broadcast)
        self.subscriber = WeightSubscriber(self.transport, self.server.apply_weights)
        self.server.control_secret = control_secret or config.inference.control_secret
        self.server.weights_source = self.subscriber.poll
        self.address = self.server.start()

    def get_address(self) -> str:
        """'host:port' that clients (on any node, when `inference.host` allows) send requests to."""
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
        """Stop the server (and vLLM's processes) and remove the exported checkpoint."""
        self.server.stop()
        self.transport.close()
        if self._export_dir is not None:
            shutil.rmtree(self._export_dir, ignore_errors=True)


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
    """Runs episodes of one environment against the inference servers (many groups concurrently)."""

    def __init__(self, config: RunConfig, env_index: int, replica: int, servers: list[str]):
        configure_logging()
        self.env_config = config.envs[env_index]
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.env = make_environment(self.env_config, self.tokenizer, seed=config.orchestrator.seed)
        self.servers = servers
        self.clients: dict[str, PolicyClient] = {}  # by role, see `_client`
        self._old_clients = dict.fromkeys(CLIENT_COUNTERS, 0.0)  # counted by clients replaced since
        self._reported = dict.fromkeys(CLIENT_COUNTERS, 0.0)
        self.timeout = config.inference.request_timeout_s
        self.eval_seed = config.orchestrator.seed if config.orchestrator.deterministic else None
        self.problems = self.env.train_problems()
        if not self.problems:
            raise ValueError(f"environment {self.env_config.name} has no training problems")

    def _client(self, role: str) -> PolicyClient:
        """This actor's client for `role`: "train", or "eval" (evaluation has its own, so that the request figures
        reported with groups are training's). Created inside the actor's event loop, at first use."""
        if role not in self.clients:
            self.clients[role] = PolicyClient(self.servers, timeout_s=self.timeout)
        return self.clients[role]

    def _counted(self, key: str) -> float:
        """Counter `key` of the live clients: retries over every client, request figures over training's."""
        roles = list(self.clients) if key == "retried_requests" else ["train"]
        return sum(getattr(self.clients[r], key) for r in roles if r in self.clients)

    def set_servers(self, servers: list[str]) -> None:
        """Send new requests to `servers` (a server was replaced); requests in flight finish where they are."""
        self.servers = list(servers)
        for key in CLIENT_COUNTERS:
            self._old_clients[key] += self._counted(key)
        self.clients = {}

    def num_problems(self) -> int:
        """Number of training problems (the driver's `ProblemIterator` hands out indices below it)."""
        return len(self.problems)

    async def run_group(self, problem_index: int, seed: int | None = None) -> dict:
        """Sample one group of `group_size` episodes of training problem `problem_index`; returns it as a dict.

        `seed` (deterministic runs): the policy calls of the group are sampled with seeds derived from it.
        """
        if not 0 <= problem_index < len(self.problems):
            raise IndexError(f"problem index {problem_index} outside the {len(self.problems)} training problems")
        problem = self.problems[problem_index]
        policy = self._client("train") if seed is None else SeededPolicy(self._client("train"), seed)
        start = time.perf_counter()
        try:
            group = await self.env.run_group(policy, problem, self.env_config.group_size, self.env_config.sampling)
        except Exception as e:
            raise EpisodeError.wrapping(e) from None
        out = group.to_dict()
        counts = self._take_client_counters()
        out["retried_requests"] = int(counts["retried_requests"])
        out["profile"] = {"group_s": time.perf_counter() - start, **{k: counts[k] for k in CLIENT_COUNTERS[1:]}}
        return out

    def _take_client_counters(self) -> dict[str, float]:
        """What this actor's clients counted (`CLIENT_COUNTERS`) since the last call; requests of groups still running
        are reported with the group that finishes next, so the run's totals are exact."""
        out = {}
        for key in CLIENT_COUNTERS:
            total = self._old_clients[key] + self._counted(key)
            out[key], self._reported[key] = total - self._reported[key], total
        return out

    def warm_start_examples(self) -> list[tuple[list[int], list[int]]]:
        """(prompt_ids, completion_ids + EOS) pairs from the environment's reference completions."""
        return reference_examples(self.env, self.tokenizer)

    def _eval_policy(self, problem: int):
        """The policy for evaluating held-out problem `problem`: seeded per problem in deterministic runs, so that an
        evaluation is a function of the weights (the same samples at every evaluation of the run)."""
        if self.eval_seed is None:
            return self._client("eval")
        seed = derived_seed(self.eval_seed, stream_id(self.env_config.name), 1 << 20, problem)
        return SeededPolicy(self._client("eval"), seed)

    async def evaluate(self) -> dict[str, float]:
        """Mean reward, pass@1 and pass@k on held-out problems (k = eval_samples_per_problem)."""
        try:
            return await self._evaluate()
        except Exception as e:
            raise EpisodeError.wrapping(e) from None

    async def _evaluate(self) -> dict[str, float]:
        cfg = self.env_config
        problems = self.env.eval_problems()[: cfg.num_eval_problems]
        k = cfg.eval_samples_per_problem
        groups = await asyncio.gather(
            *(self.env.run_group(self._eval_policy(i), p, k, cfg.sampling) for i, p in enumerate(problems))
        )
        rewards = np.array([[r.reward for r in g.rollouts] for g in groups])
        greedy = SamplingParams(temperature=0.0, max_tokens=cfg.sampling.max_tokens)
        greedy_groups = await asyncio.gather(
            *(self.env.run_group(self._eval_policy(i), p, 1, greedy) for i, p in enumerate(problems))
        )
        greedy_rewards = np.array([g.rollouts[0].reward for g in greedy_groups])
        name = cfg.name
        return {
            f"eval/{name}/reward": float(rewards.mean()),
            f"eval/{name}/pass@1": float((rewards > 0).mean()),
            f"eval/{name}/pass@{k}": float((rewards > 0).any(axis=1).mean()),
            f"eval/{name}/greedy_reward": float(greedy_rewards.mean()),
            f"eval/{name}/problems": len(problems),
        }
