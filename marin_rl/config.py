"""The experiment configuration: one YAML file (draccus) describes a whole run; `parse_config` reads it."""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import draccus
import yaml

from marin_rl.bounds import bounded, check_fields, deferred_checks, field_errors
from marin_rl.broadcast.base import BroadcastConfig
from marin_rl.cli_help import preflight
from marin_rl.envs.base import (
    Environment,
    SamplingParams,
    SingleTurnEnvironment,
    args_class,
    load_environment_class,
)
from marin_rl.envs.difficulty import PassRateConfig
from marin_rl.envs.rewards import OverlongPenalty
from marin_rl.frozen import FrozenDict, FrozenList, freeze, is_frozen
from marin_rl.inference.config import InferenceConfig, RewardModelConfig
from marin_rl.inference.engine_support import engine_refusal
from marin_rl.inference.teacher import TeacherConfig
from marin_rl.learner.algorithm import Algorithm, get_algorithm, known_algorithms, with_reward_models
from marin_rl.learner.config import LearnerConfig, routes_experts
from marin_rl.model.config import ModelConfig
from marin_rl.placement import PlacementConfig, tpu_slice_shape
from marin_rl.replay.batcher import BatcherConfig
from marin_rl.replay.buffer import ReplayConfig
from marin_rl.replay.schedule import FractionSchedule
from marin_rl.tokenizer import TokenizerConfig

# draccus builds a new argparse parser for every parse and reads each field's docstring from its class's source
# every time: about 60% of a `parse_config` (0.14 s here; the CLI, `--help`, the config walk in the tests). A class's
# source does not change while the process runs, so each (class, field) is read once. draccus' modules call it
# through the module attribute, which this replaces.
draccus.wrappers.docstring.get_attribute_docstring = functools.cache(draccus.wrappers.docstring.get_attribute_docstring)


# A frozen config's lists and dicts encode as lists and dicts wherever draccus meets them (also under `Any`).
draccus.encode.register(FrozenList, lambda obj, declared_type=None: draccus.encode(list(obj), declared_type))
draccus.encode.register(FrozenDict, lambda obj, declared_type=None: draccus.encode(dict(obj), declared_type))


@dataclass
class EnvConfig:
    """One environment type and how it is run."""

    name: str = "addition"
    """Name used in metrics and in `batcher` shares; unique per run."""
    env_class: str = "marin_rl.envs.arithmetic:AdditionEnvironment"
    """'module:Class' of an `Environment` subclass."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the environment's constructor."""
    replicas: int = bounded(1, ge=1)
    """Env actors of this type."""
    concurrency: int = bounded(8, ge=1)
    """Groups each replica generates at once."""
    group_size: int = bounded(8, ge=1)
    """Episodes per problem in a group (advantages are computed within it)."""
    fraction: float | None = bounded(None, gt=0, le=1)
    """Share of each batch's token budget, in (0, 1]; None splits what the others leave equally, unless
    `curriculum.fractions` gives this environment a schedule."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling parameters of the policy in this environment."""
    eval_samples_per_problem: int = bounded(4, ge=1)
    """Samples per held-out problem in evaluation (mean reward and pass@k are reported)."""
    num_eval_problems: int | None = bounded(None, ge=1)
    """Evaluate on the first this many held-out problems (None: all)."""
    reward_models: list[str] = field(default_factory=list)
    """Names of `reward_models` (the run's top-level list) whose scores are named rewards of this environment, each
    under the model's name and weighted by the environment's `reward_weights` (its `args.reward_weights`, or the
    class's), which must give each a weight (0 records the score without training on it)."""
    chat_template: bool = False
    """Single-turn environments: render each prompt with the tokenizer's chat template (`system_prompt`, then the
    problem as the user message, then the generation prompt) and end the policy's turn at the template's
    end-of-turn token (e.g. <|im_end|>). Multi-turn environments always render with it."""
    system_prompt: str | None = None
    """The system message of chat-rendered single-turn prompts (with `chat_template`; None: none)."""
    overlong_penalty: OverlongPenalty = field(default_factory=OverlongPenalty)
    """DAPO's soft overlong penalty of training rollouts (off unless `max_response_tokens` is set): the named reward
    'overlong' on each rollout's last sampled turn, 0 up to L_max - L_cache sampled tokens, falling linearly to -1
    at L_max, -1 beyond, added to the reward times its `weight`."""


@dataclass
class OrchestratorConfig:
    """The driver loop."""

    backend: str = "ray"
    """'ray': the learner, servers and env workers are Ray actors (one machine or a cluster). 'local': the whole
    run in this process without Ray: the learner, a colocated embedded engine sampling from the learner's own weights
    (no copy per version) and the env workers in-process (`marin_rl.orchestrator.local_backend.backend`)."""
    local_http: bool = False
    """Local backend: also serve the colocated engine's OpenAI endpoint (for tools and agents that need HTTP; the
    env workers never use it)."""
    compilation_cache_dir: str | None = "~/.cache/marin_rl/jax"
    """JAX's persistent compilation cache (local path or gs://): every process of the run (learner, servers, the
    local backend's one process) stores the programs it compiles there and loads them instead of compiling them again
    in later runs of the same shapes (the quickstart starts ~7 s sooner). Keyed by program, JAX/XLA version and
    devices, so a stale entry is never used. null: compile every time."""
    ray_address: str | None = None
    """Address of an existing Ray cluster; None starts a local one."""
    num_cpus: int | None = bounded(None, ge=1)
    """CPUs for the local Ray cluster (None: all of this machine's)."""
    num_steps: int = bounded(100, ge=1)
    """Learner steps (= policy versions) to train for."""
    max_staleness: int = bounded(1, ge=0)
    """η: no new episode starts once generation would run more than η versions ahead of the learner (0: every
    episode is sampled by the newest weights, fully synchronous)."""
    eval_every: int = bounded(25, ge=0)
    """Evaluate on held-out problems every this many steps (and always at the start and the end; 0: only then)."""
    seed: int = bounded(0, ge=0)
    """Seed for problem order (and, with `deterministic`, for sampling): any integer >= 0."""
    deterministic: bool = False
    """Make the run a deterministic function of the config, so that a resumed run ends exactly where an
    uninterrupted one does (at some cost in throughput). Requires `max_staleness: 0`. Each group is sampled with a
    seed derived from (seed, env, epoch, problem index); finished groups enter the buffers in the order their problems
    were handed out; a batch is formed only when no group is in flight; evaluation samples are seeded per held-out
    problem; the dense engine decodes at one batch shape (`inference.levanter.batch_invariant`). Exact for
    environments whose episodes are a function of the problem and the sampled tokens; `checkpoint.every` should be a
    multiple of `broadcast.sync_every` (a resumed run serves the checkpoint's weights)."""
    max_restarts_per_role: int = bounded(20, ge=0)
    """How many dead actors of one role (the inference servers together; the env actors of one environment; the
    learner, replaced as a whole and rolled back to its latest checkpoint) the driver replaces before it stops the run
    with an error naming the role. Counted from the driver's start (a resumed run starts again from 0); 0: a dead
    actor ends the run."""


@dataclass
class TrackingConfig:
    """Where metrics go: always `output_dir/metrics.jsonl`, plus Weights & Biases when enabled."""

    wandb_mode: str = "disabled"
    """'disabled', 'offline' (local files, no account) or 'online'."""
    wandb_project: str = "marin_rl"
    """W&B project."""
    run_name: str | None = None
    """Run name (defaults to the output directory's name)."""
    console_every: int = bounded(1, ge=1)
    """Print a console line every this many steps."""


@dataclass
class CheckpointConfig:
    """Checkpoints of the whole run (learner, optimizer, replay buffers, problem order) and resuming from them."""

    every: int = bounded(100, ge=0)
    """Save every this many learner steps (0: only at the end of the run and when it is interrupted)."""
    resume: bool | Literal["force"] = True
    """Resume from the latest complete checkpoint, if there is one, provided the configuration `output_dir`
    remembers (its config.yaml) differs from this one only in fields that do not change results (tracking, the
    checkpoint and evaluation cadence, orchestrator.num_steps, placement: `marin_rl.orchestrator.run_dir`); any other
    difference stops the run before it starts, listing the fields. 'force': resume even so. false: a run whose
    checkpoint directory already holds checkpoints refuses to start rather than mix runs."""
    keep: int | None = bounded(2, ge=1)
    """How many of the newest complete checkpoints to keep; older ones are deleted after each save (None: all)."""
    path: str | None = None
    """Checkpoint directory (local or gs://); None: `output_dir/checkpoints`."""
    save_on_exit: bool = True
    """Also save when the run ends or is interrupted (Ctrl-C, SIGTERM), unless that step is already saved."""

    def __post_init__(self):
        if not isinstance(self.resume, bool) and self.resume != "force":
            raise ValueError(f"checkpoint.resume must be true, false or 'force', got {self.resume!r}")
        check_fields(self, "checkpoint")


PROBLEM_SAMPLERS = ("order", "pass_rate")


@dataclass
class CurriculumConfig:
    """What a run trains on over time: environment shares that follow a schedule, and problems drawn by difficulty."""

    fractions: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Per environment name, its share of each batch's token budget as [step, fraction] points over learner steps:
    linear in between, constant before the first point and after the last (`marin_rl.replay.schedule`), e.g.
    `addition: [[0, 0.8], [50, 0.2]]`. Steps strictly increase, fractions are in [0, 1], and the shares (with the
    environments' fixed `fraction`s) may not sum above 1 at any step; environments with neither share what is
    left equally. Empty: the shares are fixed (`envs[*].fraction`)."""
    problems: str = "order"
    """How each environment's next training problem is chosen: 'order' (a seeded shuffle, each problem once per
    epoch) or 'pass_rate' (drawn with weights from the problem's recent pass rate, favouring a learnable band:
    `pass_rate`, `marin_rl.envs.difficulty`)."""
    pass_rate: PassRateConfig = field(default_factory=PassRateConfig)
    """The pass-rate sampler's band, weights and moving average (with `problems: pass_rate`)."""

    def validate(self, names: list[str], fixed: dict[str, float]) -> None:
        """Check the curriculum against the environments `names` (with fixed shares `fixed`); ValueError naming
        the field."""
        FractionSchedule(names, self.fractions, fixed)
        if self.problems not in PROBLEM_SAMPLERS:
            raise ValueError(f"curriculum.problems must be one of {PROBLEM_SAMPLERS}, got {self.problems!r}")
        unknown = sorted(set(self.pass_rate.pass_reward) - set(names))
        if unknown:
            raise ValueError(
                f"curriculum.pass_rate.pass_reward names {unknown}, which are not environments (known: {names})"
            )
        for env, reward in self.pass_rate.pass_reward.items():
            if not math.isfinite(reward):
                raise ValueError(f"curriculum.pass_rate.pass_reward[{env}]: must be finite, got {reward}")


DEFAULT_ESTIMATOR = ReplayConfig().advantage_estimator
"""`replay.advantage_estimator` when a config does not set it (then `learner.algorithm` decides it alone)."""


def _algorithm_for_estimator(estimator: str) -> str:
    """The registered algorithm whose replay side computes `estimator` (for the message that says what to set)."""
    for name in known_algorithms():
        if get_algorithm(name).advantage_estimator == estimator:
            return name
    return f"<an algorithm whose estimator is {estimator!r}>"


def _missing_local_source(path: str | None) -> str | None:
    """Why `path`, a checkpoint or tokenizer source, cannot be read, when that is clear before loading it: a local
    path that does not exist and is no Hugging Face repo id either. None when it exists, is a URL or a repo id."""
    if path is None or ("://" in path and not path.startswith("file://")):
        return None
    local = os.path.expanduser(path.removeprefix("file://"))
    if os.path.exists(local):
        return None
    if not local.startswith(("/", ".")) and local.count("/") <= 1:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(local)
            return None  # 'org/name' on the Hugging Face Hub, fetched where it is loaded
        except HFValidationError:
            pass
    return "does not exist (a local path), and is not a Hugging Face repo id either"


@dataclass
class RunConfig:
    """A whole RL experiment."""

    output_dir: str = "runs/quickstart"
    """Directory (local or gs://) for metrics, the summary, the reward plot and rollouts."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """The tokenizer."""
    envs: list[EnvConfig] = field(default_factory=lambda: [EnvConfig()])
    """Environments to train on."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """Inference servers."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """Replay buffers."""
    batcher: BatcherConfig = field(default_factory=BatcherConfig)
    """Batch assembly."""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """Optimizer, loss and warm start."""
    broadcast: BroadcastConfig = field(default_factory=BroadcastConfig)
    """Weight broadcast."""
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    """The driver loop."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Metrics."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints and resuming."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Where the learner, the inference servers and the env actors run (Ray resources, colocation, JAX memory)."""
    reward_models: list[RewardModelConfig] = field(default_factory=list)
    """Reward models served to the environments (each a checkpoint of `python -m marin_rl.reward_model`, served by
    its own reward servers); an environment uses one by naming it in its `reward_models`."""
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    """Environment shares over learner steps and difficulty-aware problem sampling (off by default)."""
    teacher: TeacherConfig | None = None
    """The teacher of on-policy distillation (`learner.algorithm: opd`), scoring every sampled token; None: none."""

    @property
    def sampling_temperature(self) -> float:
        """The run's one sampling temperature, `envs[*].sampling.temperature` (`validate` requires the environments
        to agree): the learner computes logprobs at it."""
        return self.envs[0].sampling.temperature

    def resolve(self) -> RunConfig:
        """The config as the run uses it: validated (`validate`), the settings other fields decide filled in
        (`derived`), and frozen (`marin_rl.frozen`: setting a field raises; derive a changed config with
        `dataclasses.replace` and resolve that). Every entry point resolves its config once, here; resolving a
        resolved config returns it as it is. Raises ValueError naming the field. This config is left as it is."""
        if is_frozen(self):
            return self
        self.validate()
        return freeze(self.derived())

    def derived(self) -> RunConfig:
        """A copy with the settings other fields decide filled in, the one place they are derived:
        `replay.advantage_estimator` is `learner.algorithm`'s (the algorithm decides what the replay buffers
        compute; `learner.critic.enabled` it decides as the learner config is built);
        `inference.levanter.batch_invariant` is on for `orchestrator.deterministic` runs (which groups share an
        engine batch depends on timing; results must not); `inference.levanter.record_routing` is on with
        `learner.moe.routing_replay` (the engine records what the learner replays)."""
        out = copy.deepcopy(self)
        algorithm = get_algorithm(out.learner.algorithm)
        out.replay.advantage_estimator = algorithm.advantage_estimator
        if out.orchestrator.deterministic:
            out.inference.levanter.batch_invariant = True
        if out.learner.moe.routing_replay:
            out.inference.levanter.record_routing = True
        return out

    @property
    def checkpoint_dir(self) -> str:
        """Where checkpoints go: `checkpoint.path`, or `output_dir/checkpoints`."""
        return self.checkpoint.path or os.path.join(self.output_dir, "checkpoints")

    def algorithm(self) -> Algorithm:
        """The run's algorithm, `learner.algorithm` (the one field that chooses it), with a `reward_inf` call when
        environments use reward models."""
        return with_reward_models(get_algorithm(self.learner.algorithm), self.used_reward_models())

    def used_reward_models(self) -> list[str]:
        """Names of the reward models some environment uses, in `reward_models` order."""
        used = {name for e in self.envs for name in e.reward_models}
        return [m.name for m in self.reward_models if m.name in used]

    def reward_model(self, name: str) -> RewardModelConfig:
        """The reward model called `name` (KeyError naming the known ones)."""
        for m in self.reward_models:
            if m.name == name:
                return m
        raise KeyError(f"no reward model {name!r}; reward_models has {[m.name for m in self.reward_models]}")

    def _validate_reward_models(self) -> None:
        names = [m.name for m in self.reward_models]
        if len(set(names)) != len(names):
            raise ValueError(f"reward_models: names must be unique, got {names}")
        for m in self.reward_models:
            if not m.path.strip():
                raise ValueError(
                    f"reward_models[{m.name}].path: the checkpoint directory is required (written by "
                    "python -m marin_rl.reward_model)"
                )
        used = set()
        for e in self.envs:
            unknown = sorted(set(e.reward_models) - set(names))
            if unknown:
                raise ValueError(
                    f"envs[{e.name}].reward_models names {unknown}, which are not in reward_models (known: {names})"
                )
            if len(set(e.reward_models)) != len(e.reward_models):
                raise ValueError(f"envs[{e.name}].reward_models names a model twice: {e.reward_models}")
            if not e.reward_models:
                continue
            used |= set(e.reward_models)
            weights = e.args.get("reward_weights")
            if weights is None:
                weights = load_environment_class(e.env_class).reward_weights
            missing = [n for n in e.reward_models if n not in (weights or {})]
            if missing:
                raise ValueError(
                    f"envs[{e.name}] uses reward models {missing} but its reward_weights {dict(weights or {})} give "
                    f"them no weight; set envs[{e.name}].args.reward_weights, e.g. "
                    f"{{{', '.join(f'{k}: {v}' for k, v in (weights or {}).items())}, {missing[0]}: 1.0}}"
                )
        unused = [n for n in names if n not in used]
        if unused:
            raise ValueError(
                f"reward_models {unused} are used by no environment: name them in an environment's "
                "reward_models, or remove them"
            )

    def _validate_algorithm_choice(self) -> None:
        """`learner.algorithm` chooses the algorithm, and with it the replay buffers' estimator: a config that sets
        that to something else is refused, naming the field to set instead (`critic.enabled` is checked as the
        learner config is built)."""
        algorithm = get_algorithm(self.learner.algorithm)
        estimator = self.replay.advantage_estimator
        if estimator not in (DEFAULT_ESTIMATOR, algorithm.advantage_estimator):
            raise ValueError(
                f"replay.advantage_estimator: {estimator!r}, but learner.algorithm chooses it (here "
                f"{algorithm.name!r}, whose estimator is {algorithm.advantage_estimator!r}): set learner.algorithm: "
                f"{_algorithm_for_estimator(estimator)} instead"
            )

    def _validate_sources(self) -> None:
        """A checkpoint or tokenizer named by a local path exists (checked before anything starts, instead of a
        traceback from the loader seconds later); a URL or a Hugging Face repo id is looked up where it is loaded."""
        for name, path in (("tokenizer.path", self.tokenizer.path), ("model.init_from_hf", self.model.init_from_hf)):
            problem = _missing_local_source(path)
            if problem:
                raise ValueError(f"{name}: {path!r} {problem}")

    def _validate_teacher(self) -> None:
        """A teacher exactly where the algorithm scores with one, and the loss the algorithm trains with."""
        algorithm = self.algorithm()
        objective = self.learner.loss.objective
        if algorithm.uses_teacher and (self.teacher is None or not self.teacher.path.strip()):
            raise ValueError(
                f"learner.algorithm: {algorithm.name} scores rollouts with a teacher: set teacher.path (a Hugging Face "
                "checkpoint, a run directory or a hub id)"
            )
        if self.teacher is not None and not algorithm.uses_teacher:
            raise ValueError(
                f"teacher is set, but learner.algorithm {algorithm.name!r} uses no teacher: set learner.algorithm: opd "
                "(or remove teacher)"
            )
        if algorithm.losses and objective not in algorithm.losses:
            raise ValueError(
                f"learner.loss.objective: learner.algorithm {algorithm.name} trains with "
                f"{' or '.join(repr(x) for x in algorithm.losses)}, got {objective!r}"
            )
        if self.teacher is not None and self.teacher.temperature != 1.0 and self.inference.backend == "vllm":
            raise ValueError(
                f"teacher.temperature: vLLM scores prompts at temperature 1 only, got {self.teacher.temperature} "
                "(inference.backend: vllm)"
            )
        if objective in ("opd_reverse_kl", "opd_forward_kl_topk") and not algorithm.uses_teacher:
            raise ValueError(
                f"learner.loss.objective: {objective!r} reads a teacher's logprobs: set learner.algorithm: opd "
                "and teacher.path"
            )
        top_k = 0 if self.teacher is None else self.teacher.top_k
        if objective == "opd_forward_kl_topk" and top_k == 0:
            raise ValueError(
                "teacher.top_k: the objective 'opd_forward_kl_topk' reads the teacher's top-k logprobs: set "
                "teacher.top_k > 0 (e.g. 8)"
            )
        if top_k > 0 and objective != "opd_forward_kl_topk":
            raise ValueError(
                f"teacher.top_k: {top_k} top-k logprobs per token would be carried to the learner for nothing: "
                f"learner.loss.objective {objective!r} does not read them (use 'opd_forward_kl_topk', or top_k: 0)"
            )

    def _validate_routing_replay(self) -> None:
        """Routing replay needs a mixture-of-experts policy and a sampler that records its routing."""
        if not routes_experts(self.model.architecture):
            raise ValueError(
                f"learner.moe.routing_replay: {type(self.model.architecture).__name__} has no expert layers (it needs "
                "a mixture-of-experts model: Qwen3-MoE, Mixtral)"
            )
        if self.inference.backend != "levanter" or self.inference.levanter.engine != "dense":
            raise ValueError(
                "learner.moe.routing_replay: only the embedded server's dense engine records routing; set "
                "inference.backend: levanter and inference.levanter.engine: dense"
            )

    def _validate_local(self) -> None:
        """What the local backend (one process, a colocated embedded engine) cannot run, named before it starts."""
        if self.inference.backend != "levanter":
            raise ValueError(
                "orchestrator.backend: local samples from the learner's weights with the embedded engine; "
                f"inference.backend must be 'levanter', got {self.inference.backend!r}"
            )
        if self.inference.num_servers != 1:
            raise ValueError(
                "orchestrator.backend: local runs one colocated engine in the learner's process: "
                f"set inference.num_servers: 1 (got {self.inference.num_servers})"
            )
        if self.learner.hosts > 1 and self.inference.levanter.engine != "dense":
            raise ValueError(
                f"orchestrator.backend: local with learner.hosts={self.learner.hosts} (one process per host) samples "
                "with the dense engine: set inference.levanter.engine: dense"
            )
        if self.teacher is not None and self.teacher.num_servers != 1:
            raise ValueError(
                "orchestrator.backend: local serves the teacher with one engine in the learner's process: set "
                f"teacher.num_servers: 1 (got {self.teacher.num_servers})"
            )
        if self.teacher is not None and self.learner.hosts > 1:
            raise ValueError(
                f"orchestrator.backend: local with learner.hosts={self.learner.hosts} does not serve a teacher yet "
                "(only the policy's engine runs on every host); use orchestrator.backend: ray"
            )
        if self.used_reward_models() and self.learner.hosts > 1:
            raise ValueError(
                f"orchestrator.backend: local with learner.hosts={self.learner.hosts} does not serve reward models "
                "yet (only the policy's engine runs on every host); use orchestrator.backend: ray"
            )
        if self.orchestrator.ray_address:
            raise ValueError("orchestrator.ray_address is set but orchestrator.backend is 'local' (no Ray)")

    def validate(self) -> None:
        """Check the whole config without changing it; raises ValueError naming the field. Every numeric field's
        type, finiteness and declared range (`marin_rl.bounds`), every environment class (imported here, before
        anything starts), then the cross-field checks that a single dataclass cannot do. `resolve` runs it once."""
        problems = field_errors(self)
        if problems:
            raise ValueError(problems[0])
        names = [e.name for e in self.envs]
        if not names:
            raise ValueError("envs: at least one environment is required")
        for i, e in enumerate(self.envs):
            try:
                cls = load_environment_class(e.env_class)
            except Exception as err:  # the class's module may raise anything on import: name the field
                raise ValueError(f"envs[{i}].env_class: {err}") from None
            _check_env_args(e, cls)
        self._validate_reward_models()
        self._validate_sources()
        if len(set(names)) != len(names):
            raise ValueError(f"envs: names must be unique, got {names}")
        temps = {e.sampling.temperature for e in self.envs}
        if len(temps) != 1:
            raise ValueError(f"envs[*].sampling.temperature must agree (the learner uses one), got {sorted(temps)}")
        fixed = sum(e.fraction for e in self.envs if e.fraction is not None)
        if fixed > 1 + 1e-6:
            raise ValueError(f"envs[*].fraction sum to {fixed} > 1")
        self.curriculum.validate(names, {e.name: e.fraction for e in self.envs if e.fraction is not None})
        for e in self.envs:
            e.overlong_penalty.check(f"envs[{e.name}].overlong_penalty")
            if e.system_prompt is not None and not e.chat_template:
                raise ValueError(f"envs[{e.name}].system_prompt: a system message needs chat_template: true")
        if self.tracking.wandb_mode not in ("disabled", "offline", "online"):
            raise ValueError("tracking.wandb_mode must be 'disabled', 'offline' or 'online'")
        if self.batcher.max_seq_len > self.inference.max_seq_len:
            raise ValueError("batcher.max_seq_len must not exceed inference.max_seq_len")
        self.learner.mesh.check_model(self.model.architecture)
        if self.inference.backend == "levanter":
            refusal = engine_refusal(self.model.architecture, self.inference.levanter.engine)
            if refusal:
                raise ValueError(f"inference.levanter.engine: {refusal}")
        if self.learner.moe.routing_replay:
            self._validate_routing_replay()
        if self.orchestrator.backend not in ("ray", "local"):
            raise ValueError(f"orchestrator.backend must be 'ray' or 'local', got {self.orchestrator.backend!r}")
        if self.orchestrator.backend == "local":
            self._validate_local()
        self._validate_algorithm_choice()
        algorithm = get_algorithm(self.learner.algorithm)
        estimator = algorithm.advantage_estimator
        if self.replay.dynamic_sampling and estimator == "gae":
            raise ValueError(
                f"replay.dynamic_sampling drops groups whose advantages are all zero, but algorithm {algorithm.name!r} "
                "computes them with the learner's critic (replay.advantage_estimator 'gae'): turn one of them off"
            )
        self._validate_teacher()
        self.replay.check_fits(
            max_staleness=("orchestrator.max_staleness", self.orchestrator.max_staleness),
            group_sizes={f"envs[{e.name}].group_size": e.group_size for e in self.envs},
        )
        lr = self.placement.learner
        if lr.tpu_version is not None:
            hosts, _ = tpu_slice_shape(lr.tpu_version, lr.tpu_topology)
            if self.learner.hosts != hosts:
                raise ValueError(
                    f"learner.hosts={self.learner.hosts}, but a {lr.tpu_version} {lr.tpu_topology} slice has {hosts} "
                    f"hosts: set learner.hosts: {hosts}"
                )
        if self.placement.colocate and self.inference.num_servers != self.learner.hosts:
            raise ValueError(
                "placement.colocate puts server i on learner host i: inference.num_servers "
                f"({self.inference.num_servers}) must equal learner.hosts ({self.learner.hosts})"
            )
        if self.placement.colocate and self.inference.backend != "levanter":
            raise ValueError(
                "placement.colocate shares a device between the learner and an embedded server "
                "(inference.backend: levanter); vLLM servers need devices of their own"
            )
        tp = self.inference.vllm.tensor_parallel_size
        if self.inference.backend == "vllm" and tp > 1 and self.placement.servers.num_gpus < tp:
            raise ValueError(
                f"inference.vllm.tensor_parallel_size={tp} needs placement.servers.num_gpus >= {tp} (one GPU per "
                f"shard), got {self.placement.servers.num_gpus}"
            )
        if self.orchestrator.deterministic and self.orchestrator.max_staleness != 0:
            raise ValueError(
                "orchestrator.deterministic requires orchestrator.max_staleness: 0 (groups sampled while the learner "
                f"trains would see a weight update at a timing-dependent point), got {self.orchestrator.max_staleness}"
            )

    def configure_jax(self) -> None:
        """Set this process's JAX options from the config; every process of the run calls it before its first
        compilation: `model.matmul_precision`, and `orchestrator.compilation_cache_dir` as JAX's persistent
        compilation cache (every program, however quick to compile: a run compiles a few dozen)."""
        import jax

        if self.model.matmul_precision is not None:
            jax.config.update("jax_default_matmul_precision", self.model.matmul_precision)
        path = self.orchestrator.compilation_cache_dir
        if not path:
            return
        jax.config.update("jax_compilation_cache_dir", path if "://" in path else os.path.expanduser(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    def fraction_schedule(self) -> FractionSchedule:
        """Each environment's share of a batch at a learner step: `curriculum.fractions` for the environments it
        names, `envs[*].fraction` for those that set one, an equal split of the remainder for the others."""
        fixed = {e.name: e.fraction for e in self.envs if e.fraction is not None}
        return FractionSchedule([e.name for e in self.envs], self.curriculum.fractions, fixed)

    def env_fractions(self) -> dict[str, float]:
        """Each environment's share of the first batch (unset shares split the remainder equally)."""
        return self.fraction_schedule().at(1)

    def problem_sampling(self) -> PassRateConfig | None:
        """The pass-rate sampler's settings when `curriculum.problems` is 'pass_rate', else None (the fixed
        order)."""
        return self.curriculum.pass_rate if self.curriculum.problems == "pass_rate" else None


SECRET_FIELDS = (("inference", "control_secret"), ("inference", "api_key"), ("broadcast", "secret"))
"""(section, field) of every setting that is a secret: never logged, nor written to a run directory."""


def without_secrets(data: dict[str, Any], replacement: Any) -> dict[str, Any]:
    """`data` (a config as a nested dict, changed in place) with every set `SECRET_FIELDS` value replaced."""
    for section, key in SECRET_FIELDS:
        if data.get(section, {}).get(key) is not None:
            data[section][key] = replacement
    return data


def _check_env_args(env_config: EnvConfig, cls: type) -> None:
    """ValueError naming the environment when its `args` cannot be passed to its class's constructor (an unknown
    name, a required one missing, one the run sets itself): checked against the signature, before anything starts,
    since most classes are only built in the env workers. A class that declares its arguments as a dataclass
    (`marin_rl.envs.base.EnvArgs`) has their values checked here too; other classes check theirs when built."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a constructor without an inspectable signature: its workers will say
        return
    for key in ("name", "seed"):
        if key in env_config.args:
            raise ValueError(
                f"envs[{env_config.name}].args.{key}: set by the run (envs[*].name, orchestrator.seed), not in args"
            )
    try:
        signature.bind(None, name=env_config.name, seed=0, **env_config.args)
    except TypeError as e:
        raise ValueError(f"envs[{env_config.name}].args do not fit {env_config.env_class}: {e}") from None
    declared = args_class(cls)
    if declared is not None:  # a class that declares its arguments as a dataclass: their values are checked too
        try:
            declared(name=env_config.name, seed=0, **env_config.args)
        except ValueError as e:
            raise ValueError(f"envs[{env_config.name}].args.{e}") from None
        except TypeError as e:  # a value of the wrong type that a check in its class's `__post_init__` tripped on
            raise ValueError(f"envs[{env_config.name}].args: {e}") from None


def make_environment(env_config: EnvConfig, tokenizer, seed: int, max_seq_len: int | None = None) -> Environment:
    """Instantiate an environment from its config. An environment class whose constructor takes a `max_seq_len`
    keyword gets `max_seq_len` (a run passes its `batcher.max_seq_len`: the longest episode a batch row holds)
    unless the env's `args` set it."""
    cls = load_environment_class(env_config.env_class)
    args = dict(env_config.args)
    if max_seq_len is not None and "max_seq_len" not in args and "max_seq_len" in inspect.signature(cls).parameters:
        args["max_seq_len"] = max_seq_len
    try:
        env = cls(tokenizer, name=env_config.name, seed=seed, **args)
    except TypeError as e:
        raise ValueError(f"envs[{env_config.name}].args do not fit {env_config.env_class}: {e}") from e
    if env_config.chat_template:
        if not isinstance(env, SingleTurnEnvironment):
            raise ValueError(
                f"envs[{env_config.name}].chat_template: {env_config.env_class} is not a single-turn environment "
                "(multi-turn environments always render with the chat template; set their system_prompt in args)"
            )
        env.use_chat_template(env_config.system_prompt)
    return env


def _type_name(annotation: Any) -> str:
    """How a field's type reads in a message: 'int', 'float or null', 'list of str'."""
    if annotation is type(None):
        return "null"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def _field_type(path: tuple[str, ...]) -> Any | None:
    """The annotation of the RunConfig field at draccus' key path ('envs', '0', 'group_size'), or None when a
    step cannot be followed (a choice type's own fields)."""
    annotation: Any = RunConfig
    for key in path:
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(inner) == 1:
            annotation = inner[0]
        if typing.get_origin(annotation) in (list, tuple) and key.isdigit():
            annotation = typing.get_args(annotation)[0]
        elif dataclasses.is_dataclass(annotation):
            annotation = typing.get_type_hints(annotation).get(key)
            if annotation is None:
                return None
        else:
            return None
    return annotation


_COULD_NOT_PARSE = re.compile(r"Couldn't parse '(.*?)' into an? (\w+)", re.S)
_UNDERLYING = re.compile(r'Underlying error is "(?:\w+Error: )?(.*)"', re.S)


def _value_error(e: draccus.utils.DecodingError) -> str:
    """A decoding error as '<field>: expected <type>, got <type of the value> <value>' for a value of the wrong type
    (a list for an int, a string for a float), or '<field>: <reason>' when another library's config class refused
    its values (a model architecture's own checks); other decoding errors (unknown keys) as draccus words them."""
    field = "".join(f"[{k}]" if k.isdigit() else f".{k}" for k in e.key_path).lstrip(".")
    found = _COULD_NOT_PARSE.search(e.message)
    if found is None:
        underlying = _UNDERLYING.search(e.message)
        return f"{field}: {' '.join(underlying.group(1).split())}" if underlying else str(e)
    annotation = _field_type(tuple(e.key_path))
    expected = _type_name(annotation) if annotation is not None else found.group(2)
    raw = found.group(1)  # draccus shows the value as str() does; read it back as YAML to say what it is
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):
        try:
            value = float(value)  # 'nan', 'inf', '1e-3' (which YAML 1.1 leaves a string)
        except ValueError:
            pass
    return f"{field}: expected {expected}, got {type(value).__name__} {value!r}"


def parse_config(args: list[str] | None = None) -> RunConfig:
    """Parse `--config FILE` plus dotted overrides (default: the command line) into the resolved, frozen config
    (`RunConfig.resolve`); exits with a message naming the bad key or value."""
    args = list(sys.argv[1:] if args is None else args)
    preflight(RunConfig, args)  # --help, --help-all, unknown keys
    config_path = None
    for i, a in enumerate(args):
        if a in ("--config", "--config_path") and i + 1 < len(args):
            config_path = args[i + 1]
            del args[i : i + 2]
            break
        if a.startswith(("--config=", "--config_path=")):
            config_path = a.split("=", 1)[1]
            del args[i]
            break
    try:
        with deferred_checks():  # each numeric field is checked once the tree is built, by its full name
            config = draccus.parse(RunConfig, config_path=config_path, args=args)
    except draccus.utils.DecodingError as e:
        raise SystemExit(f"marin_rl: invalid configuration: {_value_error(e)}") from None
    except FileNotFoundError as e:
        raise SystemExit(f"marin_rl: invalid configuration: {e}") from None
    except draccus.utils.ParsingError as e:  # a config's own check (__post_init__) failed: its message names the field
        raise SystemExit(f"marin_rl: invalid configuration: {e.__cause__ or e}") from None
    try:
        return config.resolve()
    except ValueError as e:
        raise SystemExit(f"marin_rl: invalid configuration: {e}") from None
