"""The learner's configuration (`learner`): the mode, the loss, the critic, the supervised warm start and
fine-tuning, and the device mesh; its optimizers are `OptimizerConfig`s (`marin_rl.learner.optimizer`) and its
adapters a `LoraConfig` (`marin_rl.model.config`).

Nothing here imports JAX: a config is read and checked without it. What needs devices or the losses' code is
imported where it is used: `check_platform` and `MeshConfig.build` ask JAX for the devices, and a loss named by
`learner.loss.objective` that is not a built-in objective is looked up in the loss registry, whose built-in losses are
JAX code (`marin_rl.learner.loss_registry`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from marin_rl.bounds import bounded, check_fields
from marin_rl.learner.algorithm import get_algorithm
from marin_rl.learner.loss_registry import get_loss
from marin_rl.learner.optimizer import OptimizerConfig
from marin_rl.model.config import LoraConfig

if TYPE_CHECKING:
    from jax.sharding import Mesh

logger = logging.getLogger(__name__)

AGGREGATIONS = ("token_mean", "sequence_mean", "fixed_budget")
"""The values of `learner.loss.aggregation`."""
OBJECTIVES = ("decoupled", "ppo", "gspo")
"""The built-in clipped objectives (`learner.loss.objective`; other names are looked up in the loss registry)."""
KL_ESTIMATORS = ("k1", "k2", "k3")
"""The values of `learner.loss.kl_estimator`."""
SEQUENCE_CORRECTIONS = ("none", "seq_tis", "mis")
"""The values of `learner.loss.sequence_correction`."""


@dataclass
class LossConfig:
    """The clipped policy-gradient objective."""

    objective: str = "decoupled"
    """'decoupled' (ratio to the proximal policy, times a capped sampler weight), 'ppo' (ratio to the sampler), 'gspo'
    (GSPO: one ratio per sequence, the exp of its tokens' mean log-ratio, see `marin_rl.learner.losses`), or
    the name of any loss in the registry (`register_loss`), or 'package.module:function' (imported, then looked
    up: a function registered there, or any loss function, which is then registered under that path)."""
    clip_low: float = bounded(0.2, ge=0)
    """ε_low: the ratio is clipped below at 1 - clip_low (0: at 1)."""
    clip_high: float = bounded(0.28, ge=0)
    """ε_high: the ratio is clipped above at 1 + clip_high (clip-higher when larger than clip_low; 0: at 1)."""
    sampler_weight_cap: float = bounded(5.0, gt=0)
    """Decoupled objective without TIS: tokens whose weight exp(logp_prox - logp_sampler) exceeds this are masked."""
    tis_cap: float | None = bounded(None, gt=0)
    """Truncated importance sampling (None: off). Each token's objective is multiplied by
    stop_gradient(min(exp(logp_prox - logp_sampler), tis_cap)), logp_prox being the learner's logprob at the proximal
    weights and logp_sampler the sampler's; the ratio is then taken to logp_prox for either objective."""
    sequence_correction: str = "none"
    """Sequence-level correction of the sampler/learner mismatch, ρ = exp(Σ over a rollout's sampled tokens of
    (logp_prox - logp_sampler)): 'none'; 'seq_tis' (each token of the rollout weighted by stop_gradient(min(ρ,
    sequence_cap)), no token dropped); 'mis' (masked IS: weight ρ, and a rollout whose ρ lies outside
    `sequence_band` is dropped whole, leaving the normaliser). Replaces the per-token weight and
    `sampler_weight_cap`; the ratio is then taken to logp_prox. Excludes `tis_cap`."""
    sequence_cap: float = bounded(2.0, gt=0)
    """'seq_tis': C, the cap of a rollout's importance weight ρ."""
    sequence_band: tuple[float, float] = (0.5, 2.0)
    """'mis': [low, high], the rollouts whose ρ lies outside are masked (0 <= low <= 1 <= high, low < high)."""
    token_mask_band: tuple[float, float] | None = None
    """IcePop token masks (None: off): [low, high]; a sampled token whose exp(logp_prox - logp_sampler) lies outside
    is masked (it leaves the loss and its normaliser), with any objective and correction (0 <= low <= 1 <= high)."""
    kl_coef: float = bounded(0.0, ge=0)
    """β of the KL penalty to a frozen reference model (the initial policy). 0: no penalty, and no reference model
    is kept or evaluated."""
    entropy_coef: float = bounded(0.0, ge=0)
    """c of the entropy bonus: the loss subtracts c × the policy's entropy over the vocabulary, aggregated over all
    sampled tokens like the KL term (0: off). Keeps exploration up; typical values are 1e-3 to 1e-2."""
    kl_estimator: str = "k3"
    """Estimator of KL(π || π_ref) per sampled token, x = logp_ref - logp: 'k1' (-x), 'k2' (x²/2) or
    'k3' (exp(x) - 1 - x, unbiased and non-negative)."""
    aggregation: str = "token_mean"
    """'token_mean' over all trained tokens of the batch, 'sequence_mean' of per-rollout token means, or
    'fixed_budget' (Dr.GRPO: token sum divided by `num_sequences × max_response_tokens`)."""
    max_response_tokens: int = bounded(128, ge=1)
    """Normaliser per rollout for aggregation='fixed_budget'."""
    opd_coef: float = bounded(1.0, ge=0)
    """On-policy distillation (objective 'opd_reverse_kl'): weight of the per-token advantage
    -(logp_sampler - logp_teacher), the teacher's logprob of each sampled token against the sampler's (0: no
    distillation, the task's advantage alone)."""
    opd_task_coef: float = bounded(0.0, ge=0)
    """On-policy distillation: weight of the task's own advantage (the replay buffers' group estimate from the
    environment's reward) added to the distillation advantage (0: distillation alone)."""
    opd_baseline: bool = False
    """On-policy distillation: subtract the mean of (logp_sampler - logp_teacher) over the sampled tokens the loss
    sees (the minibatch, or one slice of it under gradient accumulation) before weighting by `opd_coef`: a constant
    baseline, which leaves the expected gradient as it is and lowers its variance (false: the plain advantage)."""

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            try:
                get_loss(self.objective)
            except ValueError as e:
                raise ValueError(f"learner.loss.objective: {e}") from None
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"loss.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        check_fields(self, "learner.loss")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"loss.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.sequence_correction not in SEQUENCE_CORRECTIONS:
            raise ValueError(
                f"learner.loss.sequence_correction must be one of {SEQUENCE_CORRECTIONS}, got "
                f"{self.sequence_correction!r}"
            )
        _check_band("learner.loss.sequence_band", self.sequence_band)
        if self.token_mask_band is not None:
            _check_band("learner.loss.token_mask_band", self.token_mask_band)
        if self.sequence_correction != "none" and self.tis_cap is not None:
            raise ValueError(
                f"learner.loss.tis_cap ({self.tis_cap}) and learner.loss.sequence_correction "
                f"({self.sequence_correction!r}) both weigh the sampler/learner mismatch: set one of them"
            )
        if self.objective not in OBJECTIVES and (self.sequence_correction != "none" or self.token_mask_band):
            raise ValueError(
                "learner.loss.sequence_correction and token_mask_band apply to the built-in objectives "
                f"{OBJECTIVES}, not to the registered loss {self.objective!r}"
            )

    @property
    def ratio_to_proximal(self) -> bool:
        """Whether a built-in objective takes its ratio to logp_prox (decoupled, TIS or a sequence correction) rather
        than to logp_sampler."""
        return self.objective == "decoupled" or self.tis_cap is not None or self.sequence_correction != "none"

    @property
    def uses_proximal(self) -> bool:
        """Whether the loss reads logp_prox (the decoupled objective, or any objective with TIS, a sequence correction
        or token masks; for a registered loss, what it declared)."""
        if self.objective not in OBJECTIVES:
            return get_loss(self.objective).uses_proximal
        return self.ratio_to_proximal or self.token_mask_band is not None

    @property
    def kept_depends_on_proximal(self) -> bool:
        """Whether the set of trained tokens depends on logp_prox (decoupled masking by `sampler_weight_cap`, MIS or
        token masks)."""
        if self.objective not in OBJECTIVES:
            return False
        decoupled_mask = self.objective == "decoupled" and self.tis_cap is None and self.sequence_correction == "none"
        return decoupled_mask or self.sequence_correction == "mis" or self.token_mask_band is not None


def _check_band(name: str, band) -> None:
    """Refuse a band that is not two finite numbers with 0 <= low <= 1 <= high and low < high."""
    try:
        low, high = (float(x) for x in band)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be [low, high], got {band!r}") from None
    if not (math.isfinite(low) and math.isfinite(high) and 0 <= low <= 1 <= high and low < high):
        raise ValueError(f"{name} must be [low, high] with 0 <= low <= 1 <= high and low < high, got {list(band)}")


CRITIC_TRUNKS = ("separate", "policy")
"""The values of `learner.critic.trunk`."""


@dataclass
class CriticConfig:
    """PPO's value model and generalized advantage estimation (off by default: group baselines need no critic)."""

    enabled: bool = False
    """Train a critic and compute advantages by GAE. Needs `replay.advantage_estimator: gae`."""
    trunk: str = "separate"
    """'separate': the critic is a language model of its own with a value head (a copy of the policy's trunk taken at
    the start of RL, after the warm start, or `init_from_hf`), all of it trained by the value loss. 'policy': a value
    head on the policy's own trunk, which it reads as it is at each call without training it (the value loss's
    gradients stop at the trunk); only the head is the critic's, so the critic costs no second model."""
    init_from_hf: str | None = None
    """'separate' trunk only: the critic's trunk from this Hugging Face checkpoint (local or fsspec URL; the
    policy's architecture). None: a copy of the policy's trunk."""
    gamma: float = bounded(1.0, ge=0, le=1)
    """Discount γ per sampled token, in [0, 1] (0: each token's own reward only)."""
    lam: float = bounded(0.95, ge=0, le=1)
    """GAE's λ: 1 gives Monte Carlo returns minus V, 0 one-step TD errors."""
    lam_between_turns: float | None = bounded(None, ge=0, le=1)
    """λ across a turn boundary (environment tokens between two sampled tokens of an episode); None: `lam`. With
    `lam: 1` and `lam_between_turns: 0` each turn's tokens get that turn's reward plus γ·V(next turn) − V: credit per
    turn, with no later turn's reward in it (GAE over turns as steps)."""
    value_clip: float | None = bounded(0.2, gt=0)
    """ε_V of the clipped value loss (None: unclipped squared error)."""
    whiten_advantages: bool = True
    """Shift and scale each batch's advantages to mean 0 and standard deviation 1 over its sampled tokens."""
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(learning_rate=1e-3))
    """The critic's AdamW and learning-rate schedule (its own optimizer state; schedules count critic steps, one per
    train step)."""

    def __post_init__(self):
        check_fields(self, "learner.critic")
        if self.trunk not in CRITIC_TRUNKS:
            raise ValueError(f"learner.critic.trunk must be one of {CRITIC_TRUNKS}, got {self.trunk!r}")
        if self.trunk == "policy" and self.init_from_hf is not None:
            raise ValueError(
                "learner.critic.init_from_hf is for a separate trunk; with trunk: policy the critic reads "
                "the policy's own trunk"
            )


@dataclass
class WarmStartConfig:
    """Optional supervised warm start on the environments' reference solutions, before RL begins."""

    steps: int = bounded(0, ge=0)
    """Supervised optimizer steps (0: none). The RL phase starts from the result, at policy version 0."""
    learning_rate: float = bounded(3e-3, gt=0)
    """Learning rate of the warm start (AdamW, constant)."""
    batch_rows: int = bounded(32, ge=1)
    """Rows of `max_seq_len` tokens per supervised batch."""
    cache_dir: str | None = "~/.cache/marin_rl/warm_start"
    """Where warm-started weights are kept for reuse (local path or fsspec URL): a later warm start with the same
    initial weights, demonstrations, settings, device layout and code (library versions and marin_rl's source) loads
    them instead of training again, bit-identical (`marin_rl.learner.warm_start_cache`). null: always train."""
    cache_max_mb: int = bounded(1024, ge=0)
    """Largest policy (MB of weights) whose warm start is cached; larger ones always train (0: none is cached)."""

    def __post_init__(self):
        check_fields(self, "learner.warm_start")


LEARNER_MODES = ("rl", "sft")
"""The values of `learner.mode`."""
PLATFORMS = ("cpu", "gpu", "tpu")
"""The values of `learner.platform`."""


def check_platform(platform: str | None) -> None:
    """Raise ValueError, naming the devices JAX finds, when they are not of `platform` ('gpu' also matches JAX's
    'cuda' and 'rocm'); None accepts any."""
    if platform is None:
        return
    import jax

    devices = jax.devices()
    found = devices[0].platform
    if found == platform or (platform == "gpu" and found in ("cuda", "rocm")):
        return
    raise ValueError(
        f"learner.platform: this experiment is sized for {platform}, but JAX finds only {found} devices "
        f"({len(devices)} {devices[0].device_kind}); run it where JAX sees a {platform} (check the jax install's "
        f"{platform} support), or set learner.platform: null to run it here anyway"
    )


@dataclass
class SftConfig:
    """Supervised fine-tuning (`learner.mode: sft`, see `marin_rl.programs.sft`): prompt/completion records, packed
    into rows of `batcher.max_seq_len` tokens like RL batches, trained with the loss on completion tokens only."""

    train_files: list[str] = field(default_factory=list)
    """JSONL or Parquet files of training records: local paths, fsspec URLs (`gs://...`) or globs."""
    eval_files: list[str] = field(default_factory=list)
    """Held-out records in the same format; empty: hold out `eval_fraction` of the training records."""
    eval_fraction: float = bounded(0.05, gt=0, lt=1)
    """Share of the training records held out (seeded shuffle) when `eval_files` is empty; in (0, 1)."""
    prompt_field: str = "prompt"
    """Record field holding the prompt text."""
    completion_field: str = "completion"
    """Record field holding the completion text (the only tokens the loss is computed on)."""
    chat_template: bool = False
    """Render each record with the tokenizer's chat template as a user turn (the prompt) and an assistant turn (the
    completion, ending with the template's end of turn). False: plain prompt text followed by the completion text."""
    append_eos: bool = True
    """Plain records (chat_template false): end every completion with the tokenizer's EOS token, so the policy
    learns to stop."""
    steps: int = bounded(0, ge=0)
    """Optimizer steps; 0: `epochs` passes over the training records."""
    epochs: int = bounded(1, ge=1)
    """Passes over the training records (shuffled each pass) when `steps` is 0."""
    batch_rows: int = bounded(32, ge=1)
    """Rows of `batcher.max_seq_len` tokens per batch (several records per row, as the batcher packs rollouts)."""
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(learning_rate=1e-3))
    """AdamW, warmup and gradient clipping of the supervised steps."""
    eval_every: int = bounded(0, ge=0)
    """Evaluate the held-out loss every this many steps (0: only before the first and after the last step)."""
    max_eval_records: int | None = bounded(None, ge=1)
    """Evaluate on at most this many held-out records (None: all)."""
    log_every: int = bounded(10, ge=1)
    """Print a console line every this many steps (every step is logged to the tracker)."""
    seed: int = bounded(0, ge=0)
    """Seed of the held-out split and of the shuffling (an integer >= 0)."""

    def __post_init__(self):
        check_fields(self, "learner.sft")
        for name in ("train_files", "eval_files"):
            files = getattr(self, name)
            if isinstance(files, str) or any(not isinstance(f, str) or not f.strip() for f in files):
                raise ValueError(f"learner.sft.{name} must be a list of file paths or URLs, got {files!r}")
        for name in ("prompt_field", "completion_field"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"learner.sft.{name} must be a non-empty field name, got {getattr(self, name)!r}")


MESH_AXES = ("data", "fsdp", "tensor")
"""Physical axes every learner mesh has, in order (with `learner.mesh.expert` > 1 also `EXPERT_AXIS`, after "data")."""
EXPERT_AXIS = "expert"
"""The expert-parallel mesh axis: present only when `learner.mesh.expert` > 1."""
EXPERTS = "experts"
"""The named axis of Levanter's mixture-of-experts parameters (`config.Experts` of Mixtral and Qwen3-MoE): the
stacked experts' weights (`MoELinear`) and the router's output."""


def routes_experts(architecture) -> bool:
    """Whether a Levanter architecture has mixture-of-experts layers (Mixtral, Qwen3-MoE)."""
    return hasattr(architecture, "num_experts_per_tok")


@dataclass
class MeshConfig:
    """The learner's device mesh and how named axes map onto it.

    The mesh has three physical axes, `data × fsdp × tensor` (`MESH_AXES`), and a fourth, `expert` (after `data`),
    when `expert` > 1: batch rows are split over `data`, `expert` and `fsdp`, parameters and optimizer state over
    `fsdp` (their `embed` axis by default), `tensor` (`mlp`, `heads`, `kv_head`) and `expert` (the experts of a
    mixture-of-experts model). The same config runs on CPU, GPU and TPU devices. On a single device the learner uses
    no mesh at all.

    Mappings may name the `expert` axis whatever its size; with `expert` = 1 the mesh has no such axis and those
    mappings drop it (a size-1 axis splits nothing), so the mesh, the mappings and every placement are exactly those
    of a three-axis mesh.
    """

    data: int = bounded(-1, ge=1, also=(-1,))
    """Size of the data-parallel axis; -1: all devices that `expert × fsdp × tensor` leaves."""
    fsdp: int = bounded(1, ge=1)
    """Size of the fully-sharded data-parallel axis: batch rows and parameters (see `param_mapping`) split over it."""
    tensor: int = bounded(1, ge=1)
    """Size of the tensor-parallel axis: the named axes that `compute_mapping` maps to "tensor" split over it."""
    expert: int = bounded(1, ge=1)
    """Size of the expert-parallel axis (mixture-of-experts models only; it must divide their number of experts):
    each device keeps `1/expert` of every layer's experts (and of the router's weight) and of their optimizer state
    (`param_mapping` maps the `experts` axis to it), and batch rows are split over it too, as over `data` (the usual
    expert-parallel layout: the expert devices are data-parallel for everything but the experts). 1: no expert axis
    (the default). How the experts' matrix products run on split weights is XLA's choice (`marin_rl.learner.sharding`
    says more): exact either way, with an all-gather at worst a step briefly holds one layer's full experts."""
    compute_mapping: dict[str, str | list[str]] = field(
        default_factory=lambda: {
            "batch": ["data", EXPERT_AXIS, "fsdp"],
            "mlp": "tensor",
            "heads": "tensor",
            "kv_head": "tensor",
        }
    )
    """Named (logical) axis → mesh axis or axes, for activations and the batch; also the base of `param_mapping`.
    Axes not named here are replicated. It may not map `experts`: Levanter's routers take the softmax and top-k over
    the experts inside shard_maps that must see them all (tracing fails); `param_mapping` splits the experts."""
    param_mapping: dict[str, str | list[str]] = field(default_factory=lambda: {"embed": "fsdp", EXPERTS: EXPERT_AXIS})
    """Overrides of `compute_mapping` for parameters and optimizer state (FSDP: the `embed` axis over "fsdp"; expert
    parallelism: the `experts` axis over "expert")."""

    def __post_init__(self):
        check_fields(self, "learner.mesh")
        axes = (*MESH_AXES, EXPERT_AXIS)
        for which in ("compute_mapping", "param_mapping"):
            for axis, target in getattr(self, which).items():
                targets = [target] if isinstance(target, str) else list(target)
                unknown = [t for t in targets if t not in axes]
                if unknown or not targets:
                    raise ValueError(f"learner.mesh.{which}[{axis!r}] = {target!r} must name mesh axes among {axes}")
        if EXPERTS in self.compute_mapping:
            raise ValueError(
                f"learner.mesh.compute_mapping[{EXPERTS!r}]: Levanter's mixture-of-experts routers need every expert "
                f"on each device; split the experts' parameters with learner.mesh.param_mapping[{EXPERTS!r}] instead"
            )

    def check_model(self, architecture) -> None:
        """Raise ValueError naming `learner.mesh.expert` when it is > 1 and `architecture` (a Levanter config) has no
        experts, or does not split them evenly, or `param_mapping` does not put them on the expert axis."""
        if self.expert == 1:
            return
        if not routes_experts(architecture):
            raise ValueError(
                f"learner.mesh.expert={self.expert}, but {type(architecture).__name__} has no mixture-of-experts "
                "layers: expert parallelism needs Mixtral or Qwen3-MoE; set learner.mesh.expert: 1"
            )
        experts = architecture.Experts
        if experts.size % self.expert != 0:
            raise ValueError(
                f"learner.mesh.expert={self.expert} does not divide the model's {experts.size} experts; choose a "
                "divisor of the number of experts"
            )
        target = self.param_axis_mapping.get(experts.name, ())
        if EXPERT_AXIS not in ((target,) if isinstance(target, str) else target):
            raise ValueError(
                f"learner.mesh.expert={self.expert}, but learner.mesh.param_mapping[{experts.name!r}] = "
                f"{target or None!r} does not split the experts over the {EXPERT_AXIS!r} axis"
            )

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh's physical axes, in order: `MESH_AXES`, with `EXPERT_AXIS` after "data" when `expert` > 1."""
        return ("data", EXPERT_AXIS, "fsdp", "tensor") if self.expert > 1 else MESH_AXES

    def shape(self, num_devices: int) -> dict[str, int]:
        """The mesh's axis sizes on `num_devices` devices; raises ValueError when the mesh does not fit them."""
        sizes = {"expert": self.expert} if self.expert > 1 else {}
        sizes.update(fsdp=self.fsdp, tensor=self.tensor)
        rest = math.prod(sizes.values())
        named = " × ".join(f"{k}={v}" for k, v in sizes.items())
        if self.data == -1:
            if num_devices % rest != 0:
                raise ValueError(
                    f"learner.mesh: {named} = {rest} does not divide the {num_devices} available devices; choose "
                    "sizes whose product divides the device count"
                )
            data = num_devices // rest
        else:
            data = self.data
        size = data * rest
        if size > num_devices:
            raise ValueError(
                f"learner.mesh: data={data} × {named} = {size} devices, but only {num_devices} are available "
                "(jax.devices())"
            )
        return {axis: data if axis == "data" else sizes[axis] for axis in self.axes}

    def build(self, devices: list | None = None, *, single: bool = False) -> Mesh | None:
        """A `jax.sharding.Mesh` over the first `data × expert × fsdp × tensor` of `devices` (default:
        `jax.devices()`), with the axes `axes`, or None when that is a single device (then the learner runs
        unsharded, exactly as without a mesh) unless `single` (a model whose layers need a mesh even on one
        device)."""
        import jax
        from jax.sharding import Mesh

        devices = list(jax.devices() if devices is None else devices)
        shape = self.shape(len(devices))
        size = math.prod(shape.values())
        if size == 1 and not single:
            return None
        if size < len(devices):
            logger.warning("learner.mesh uses %d of the %d devices", size, len(devices))
        grid = np.asarray(devices[:size], dtype=object).reshape(tuple(shape.values()))
        return Mesh(grid, tuple(shape))

    def _resolved(self, mapping: dict) -> dict[str, str | tuple[str, ...]]:
        """`mapping` as haliax takes it (tuples), without the expert axis when the mesh has none."""
        resolved = {}
        for axis, target in mapping.items():
            targets = tuple(t for t in ((target,) if isinstance(target, str) else target) if t in self.axes)
            if targets:
                resolved[axis] = targets[0] if isinstance(target, str) else targets
        return resolved

    @property
    def compute_axis_mapping(self) -> dict[str, str | tuple[str, ...]]:
        """haliax resource mapping for activations and batches."""
        return self._resolved(self.compute_mapping)

    @property
    def param_axis_mapping(self) -> dict[str, str | tuple[str, ...]]:
        """haliax resource mapping for parameters and optimizer state."""
        return {**self.compute_axis_mapping, **self._resolved(self.param_mapping)}


@dataclass
class MoeConfig:
    """Mixture-of-experts training (Qwen3-MoE, Mixtral policies)."""

    routing_replay: bool = False
    """Routing replay: the sampler records, per token and expert layer, the experts it sent the token to; they travel
    with the rollout to the packed batch, and the learner's forward sends each token to the same experts (the gates
    are still the router's probabilities there, so the router trains). It removes the sampler–learner mismatch that
    routing flips cause. Needs a mixture-of-experts model sampled by the embedded server's dense engine
    (`inference.backend: levanter`, `inference.levanter.engine: dense`); `marin_rl.model.moe`."""

    def __post_init__(self):
        check_fields(self, "learner.moe")


@dataclass
class LearnerConfig:
    """The learner: RL or supervised mode, optimizer, loss, supervised warm start and fine-tuning, device mesh."""

    mode: str = "rl"
    """'rl': the asynchronous RL loop (environments, inference servers, replay). 'sft': supervised fine-tuning on
    the prompt/completion records of `sft` with the same model, tokenizer, packing (`batcher.max_seq_len`) and mesh,
    then an HF export that an RL run can start from (`model.init_from_hf`); no Ray, servers or environments."""
    sft: SftConfig = field(default_factory=SftConfig)
    """Supervised fine-tuning (used when `mode` is 'sft')."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer of the RL phase."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Policy-gradient loss."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised warm start before RL."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Device mesh and axis mappings (data / fsdp / tensor / expert parallelism), over the devices of every host."""
    hosts: int = bounded(1, ge=1)
    """Learner processes, one per host: with more than one, they join one JAX distributed runtime
    (`jax.distributed`) and the mesh spans every host's devices (placement: `placement.learner`)."""
    minibatches: int = bounded(1, ge=1)
    """Split each batch's rows into this many minibatches, one optimizer step each. The batch's rows must divide
    evenly into `minibatches × microbatches`."""
    epochs: int = bounded(1, ge=1)
    """Passes over each batch's minibatches. With minibatches × epochs > 1 the proximal logprobs (and the reference
    model's) are computed once per batch, before its first optimizer step; a batch is still one policy version."""
    microbatches: int = bounded(1, ge=1)
    """Gradient accumulation: split each minibatch's rows into this many chunks, run forward and backward one chunk
    at a time and sum the gradients, normalised by the whole minibatch (the same step as without splitting)."""
    offload_optimizer: bool = False
    """Keep the optimizer state in host memory between train steps (pinned host memory where the devices have it,
    else this process's RAM), and bring it back for each step: while a colocated engine generates, the devices hold
    the policy and the KV cache but not the optimizer's moments (peers' sleep/wake). Costs a host round trip of the
    optimizer state per step."""
    algorithm: str = "rloo"
    """The algorithm, a declared graph of model calls (`marin_rl.learner.algorithm`), the one field that chooses it:
    'rloo', 'grpo', 'dr_grpo', 'reinforce', 'remax', 'turn_rloo', 'ppo' (critic and GAE), 'opd' (on-policy
    distillation), a name registered with `register_algorithm`, or 'package.module:NAME'. It decides
    `replay.advantage_estimator` and `critic.enabled` (a config that sets them otherwise is refused)."""
    platform: str | None = None
    """The accelerator the experiment is sized for: 'gpu', 'tpu' or 'cpu'. A learner whose JAX devices are another
    platform refuses to start, in one line naming what it found (a ~100M-parameter experiment would take hours on a
    laptop's CPU); the local backend checks it before anything starts. null: whatever JAX finds."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA (`rank > 0`): after the warm start (which, like `model.init_from_hf`, makes the base) the learner trains
    low-rank adapters on the linear layers and nothing else; versions carry only the adapters, the servers merge them
    into the base; the KL reference is the base itself (no second copy). `learner.mode: sft` trains adapters too."""
    moe: MoeConfig = field(default_factory=MoeConfig)
    """Mixture-of-experts options (routing replay)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """PPO's value model and GAE (`enabled: true`, with `replay.advantage_estimator: gae`): each train step computes
    the critic's values of the batch, GAE advantages and returns, the policy's steps, then one critic step on the
    whole batch (`marin_rl.learner.critic`)."""

    def __post_init__(self):
        check_fields(self, "learner")
        if self.mode not in LEARNER_MODES:
            raise ValueError(f"learner.mode must be one of {LEARNER_MODES}, got {self.mode!r}")
        if self.platform is not None and self.platform not in PLATFORMS:
            raise ValueError(f"learner.platform must be one of {PLATFORMS} or null, got {self.platform!r}")
        try:
            algorithm = get_algorithm(self.algorithm)
        except ValueError as e:
            raise ValueError(f"learner.algorithm: {e}") from None
        has_critic = "critic" in algorithm.roles
        if self.critic.enabled and not has_critic:
            raise ValueError(
                f"learner.critic.enabled: true, but learner.algorithm chooses whether a critic trains (here "
                f"{algorithm.name!r}, which has none): set learner.algorithm: ppo instead"
            )
        if self.critic.enabled != has_critic:  # a new critic config: the one given may be part of a frozen config
            self.critic = dataclasses.replace(self.critic, enabled=has_critic)
        if self.mode == "sft" and not self.sft.train_files:
            raise ValueError("learner.sft.train_files must name at least one file when learner.mode is 'sft'")
