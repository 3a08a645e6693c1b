"""Algorithms as declared graphs of model calls.

An `Algorithm` is data: the model roles it uses (actor, critic, ref, reward), and its calls — generate, inference,
train or compute — each with the role that runs it, the keys it reads and the keys it writes, and where it runs:

* on the **rollout side** (env actors and replay buffers): generation and the group-level estimators, configured by
  the algorithm (`advantage_estimator`, a greedy baseline episode for ReMax);
* on the **learner**: the algorithm's `step`, one plain function that runs its learner calls top to bottom on
  every batch (`Learner.train_step`; PPO's `ppo_step`: the critic's values, GAE, the actor's steps, the critic's step).

`Algorithm.ordered()` checks the graph when a run starts — every key a call reads is an input or written upstream,
every role is known, no cycle, every declared learner call has a step that runs it — and names what is wrong. The
graph is what `python -m marin_rl.graph` draws and what the rollout side is configured from; the step function is
what runs. GRPO, RLOO, Dr.GRPO, REINFORCE, ReMax, on-policy distillation and PPO (critic and GAE) are shipped;
`learner.algorithm` chooses one. A new algorithm is a graph plus, when its learner side is more than the actor's train
call, its step function, registered from user code (`register_algorithm`); nothing in the orchestrator changes.
`python -m marin_rl.graph --config X` draws the configured graph (DOT and PNG) and lists its calls in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from marin_rl.replay.advantages import get_estimator

ROLES = ("actor", "critic", "ref", "reward", "teacher")
"""Model roles a call can run on ('env' for calls of the environments, 'replay' for the replay buffers)."""
CALL_KINDS = ("generate", "inference", "train", "compute")
SIDES = ("rollout", "learner")
INPUTS = ("prompts",)
"""Keys the loop provides before any call (problems handed to the env actors)."""
DELIVERED = ("rollouts", "advantages", "token_rewards", "teacher_logprobs")
"""Rollout-side keys that reach the learner in its batches: the packed rollouts, their group advantages (per token),
per-token rewards (`replay.advantage_estimator: gae`) and a teacher's logprob of each sampled token (`teacher_inf`).
Other rollout-side keys stay on the rollout side."""


@dataclass(frozen=True)
class Call:
    """One call of an algorithm's graph."""

    name: str
    """Unique within the graph, e.g. 'critic_inf'."""
    role: str
    """The model role that runs it (`ROLES`), or 'env' / 'replay' for rollout-side computation."""
    kind: str
    """'generate', 'inference', 'train' or 'compute'."""
    reads: tuple[str, ...]
    """Keys it needs (inputs or written by earlier calls)."""
    writes: tuple[str, ...]
    """Keys it produces."""
    side: str = "learner"
    """'rollout' (env actors and replay buffers) or 'learner' (run by the algorithm's `step`)."""


@dataclass(frozen=True)
class Algorithm:
    """A declared algorithm: its calls, and what its rollout side computes."""

    name: str
    """Name it is chosen by (`learner.algorithm`)."""
    calls: tuple[Call, ...]
    """The calls, in any order (`ordered` sorts them)."""
    advantage_estimator: str
    """What the replay buffers compute (`replay.advantage_estimator`): a group estimator, or 'gae' for none (the
    batches carry per-token rewards for learner-side estimation)."""
    description: str = ""
    """One line for listings."""
    reward_models: tuple[str, ...] = ()
    """Reward models whose scores enter the rewards (`with_reward_models`), by name."""
    loss: str | None = None
    """The loss it trains with (`learner.loss.objective` must name it or one of `other_losses`), or None: any loss."""
    other_losses: tuple[str, ...] = ()
    """Further losses it may train with, besides `loss`."""
    step: LearnerStep | None = None
    """Its learner side on one batch, a plain function (`LearnerStep`) that runs the graph's learner calls in order;
    None: `actor_step` (the actor's train call alone, on the advantages the batch carries)."""

    @property
    def greedy_baseline(self) -> bool:
        """Env workers sample a greedy episode with each group (ReMax): what its advantage estimator declares
        (`marin_rl.replay.advantages.RegisteredEstimator.greedy_baseline`)."""
        return get_estimator(self.advantage_estimator).greedy_baseline

    def train_step(self, learner, batch, placed, *, loss, loss_weight_fn) -> dict[str, Any]:
        """Run the learner side on one batch (`step`, or `actor_step`); returns its metrics."""
        step = self.step or actor_step
        return step(learner, batch, placed, loss=loss, loss_weight_fn=loss_weight_fn)

    @property
    def losses(self) -> tuple[str, ...]:
        """The losses it may train with (empty: any)."""
        return () if self.loss is None else (self.loss, *self.other_losses)

    @property
    def uses_teacher(self) -> bool:
        """Whether a teacher scores the rollouts (a call on the 'teacher' role): the run then needs `teacher`."""
        return any(c.role == "teacher" for c in self.calls)

    @property
    def roles(self) -> tuple[str, ...]:
        """The model roles its calls run on, in `ROLES` order."""
        used = {c.role for c in self.calls}
        return tuple(r for r in ROLES if r in used)

    def ordered(self) -> list[Call]:
        """The calls in an order where each runs after every call it reads from; raises ValueError naming a missing
        key (and who reads it), an unknown role or kind, a duplicate name or writer, or a cycle."""
        names = [c.name for c in self.calls]
        if len(set(names)) != len(names):
            raise ValueError(f"algorithm {self.name!r}: call names repeat: {names}")
        writer: dict[str, Call] = {}
        for c in self.calls:
            if c.role not in (*ROLES, "env", "replay"):
                raise ValueError(
                    f"algorithm {self.name!r}: call {c.name!r} runs on unknown role {c.role!r}; "
                    f"roles are {ROLES} (or 'env', 'replay' on the rollout side)"
                )
            if c.kind not in CALL_KINDS:
                raise ValueError(f"algorithm {self.name!r}: call {c.name!r} has unknown kind {c.kind!r} {CALL_KINDS}")
            if c.side not in SIDES:
                raise ValueError(f"algorithm {self.name!r}: call {c.name!r} has unknown side {c.side!r} {SIDES}")
            for key in c.writes:
                if key in writer or key in INPUTS:
                    other = writer[key].name if key in writer else "the loop's inputs"
                    raise ValueError(f"algorithm {self.name!r}: key {key!r} is written by {other!r} and {c.name!r}")
                writer[key] = c
        for c in self.calls:
            for key in c.reads:
                if key not in writer and key not in INPUTS:
                    raise ValueError(
                        f"algorithm {self.name!r}: call {c.name!r} reads {key!r}, which no call writes "
                        f"(written: {sorted(writer)}; inputs: {list(INPUTS)})"
                    )
        order: list[Call] = []
        state: dict[str, int] = {}  # 1: on the path, 2: done

        def visit(c: Call, path: list[str]) -> None:
            if state.get(c.name) == 2:
                return
            if state.get(c.name) == 1:
                raise ValueError(f"algorithm {self.name!r} has a cycle: {' -> '.join([*path, c.name])}")
            state[c.name] = 1
            for key in c.reads:
                if key in writer:
                    visit(writer[key], [*path, c.name])
            state[c.name] = 2
            order.append(c)

        for c in self.calls:
            visit(c, [])
        rollout_after_learner = [
            c.name
            for c in order
            if c.side == "rollout" and any(writer[k].side == "learner" for k in c.reads if k in writer)
        ]
        if rollout_after_learner:
            raise ValueError(
                f"algorithm {self.name!r}: rollout-side calls {rollout_after_learner} read what the "
                "learner writes; the rollout side runs before the learner"
            )
        return order

    def learner_calls(self) -> list[Call]:
        """The learner-side calls in order. ValueError when one reads a key that stays on the rollout side, or when
        calls besides the actor's train call are declared without a `step` to run them."""
        ordered = self.ordered()
        rollout_keys = {k for c in ordered if c.side == "rollout" for k in c.writes}
        calls = [c for c in ordered if c.side == "learner"]
        for c in calls:
            kept = [k for k in c.reads if k in rollout_keys and k not in DELIVERED]
            if kept:
                raise ValueError(
                    f"algorithm {self.name!r}: learner call {c.name!r} reads {kept}, which stay on the "
                    f"rollout side (batches deliver {list(DELIVERED)})"
                )
        default = len(calls) == 1 and calls[0].role == "actor" and calls[0].kind == "train"
        if self.step is None and calls and not default:
            raise ValueError(
                f"algorithm {self.name!r} declares learner calls {[c.name for c in calls]} but no step function "
                "to run them; the default step (actor_step) runs only the actor's train call: give "
                "Algorithm(step=...) a function that runs them in order"
            )
        return calls


LearnerStep = Callable[..., dict[str, Any]]
"""`step(learner, batch, placed, *, loss, loss_weight_fn) -> metrics`: an algorithm's learner side on one batch.
`batch` is the host `PackedBatch` (its `advantages`, or per-token `rewards` with `replay.advantage_estimator: gae`),
`placed` the same batch on the devices (`Learner.place_batch`); the learner's parts are `learner.actor_train` (the
policy's optimizer steps, on the batch's advantages or given ones) and, with a critic role, `learner.critic`'s
`values`, `gae` and `train`. `loss`/`loss_weight_fn` go to `actor_train`. The learner increments the policy version
after it."""

_ALGORITHMS: dict[str, Algorithm] = {}


def actor_step(learner, batch, placed, *, loss, loss_weight_fn) -> dict[str, Any]:
    """The group algorithms' and distillation's learner side: the actor's steps on the advantages the batch carries
    (with a teacher, the batch carries its logprobs too, which the distillation losses read)."""
    return learner.actor_train(batch, placed, loss=loss, loss_weight_fn=loss_weight_fn)


def ppo_step(learner, batch, placed, *, loss, loss_weight_fn) -> dict[str, Any]:
    """PPO's learner side, top to bottom: the critic's values of the batch before any update, GAE over its per-token
    rewards on the devices, the actor's steps on those advantages, one critic step towards the returns."""
    advantages, returns, values, gae_metrics = learner.critic.advantages(batch, placed)  # values, then GAE
    metrics = learner.actor_train(batch, placed, loss=loss, loss_weight_fn=loss_weight_fn, advantages=advantages)
    critic_metrics = learner.critic.train(placed, values, returns)
    prefixed = {f"learner/{k}": v for k, v in gae_metrics.items()}
    return {**prefixed, **metrics, **{f"learner/{k}": v for k, v in critic_metrics.items()}}


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    """Register (or replace) `algorithm` under its name, after checking its graph (`ordered`); returns it."""
    algorithm.ordered()
    _ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def known_algorithms() -> list[str]:
    """Names of the registered algorithms."""
    return sorted(_ALGORITHMS)


def get_algorithm(name: str) -> Algorithm:
    """The registered algorithm `name`; 'package.module:NAME' imports the module first (which registers it). Raises
    ValueError naming the known ones."""
    if name not in _ALGORITHMS and ":" in name:
        import importlib

        module, _, attr = name.partition(":")
        try:
            found = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"algorithm {name!r} cannot be imported: {e}") from e
        if not isinstance(found, Algorithm):
            raise ValueError(f"{name!r} is not an Algorithm")
        return register_algorithm(found) if found.name not in _ALGORITHMS else _ALGORITHMS[found.name]
    if name not in _ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; registered: {known_algorithms()} (or 'package.module:NAME')")
    return _ALGORITHMS[name]


MODEL_REWARDS = "model_rewards"
"""The key the `reward_inf` call writes: reward models' scores of the rollouts."""
REWARD_KEYS = ("rewards", "token_rewards", "greedy_rewards")
"""Keys of rewards that generate calls write (what an advantage estimate reads)."""


def with_reward_models(algorithm: Algorithm, names: tuple[str, ...] | list[str]) -> Algorithm:
    """`algorithm` with reward models: a rollout-side `reward_inf` call (role 'reward', kind 'inference') reads the
    rollouts and writes `model_rewards`, which the advantage estimate then reads beside the verifiers' rewards.

    The env actors score every episode with the models as it ends, so the models' rewards join the environment's named
    rewards (weighted by its `reward_weights`) before any advantage is computed. A rollout-side call that reads a
    generated reward key (a group estimator) reads `model_rewards` too. When a learner call reads one (PPO's GAE reads
    `token_rewards`), the generate call writes `rewards` instead and a rollout-side `reward_credit` call (the replay
    buffer crediting episode rewards to tokens) reads `rewards` and `model_rewards` and writes it. Unchanged when
    `names` is empty; the name and learner calls stay those of `algorithm`."""
    names = tuple(names)
    if not names:
        return algorithm
    calls = list(algorithm.calls)
    generated = {k for c in calls if c.kind == "generate" for k in c.writes if k in REWARD_KEYS}
    learner_read = sorted({k for c in calls if c.side == "learner" for k in c.reads if k in generated})
    if learner_read and "rewards" in generated:
        raise ValueError(
            f"algorithm {algorithm.name!r}: generate calls write 'rewards' and learner calls read "
            f"{learner_read}; with_reward_models cannot route model rewards into both"
        )
    out = []
    for c in calls:
        if c.kind == "generate" and learner_read:
            writes = tuple("rewards" if k in learner_read else k for k in c.writes)
            c = dataclasses.replace(c, writes=tuple(dict.fromkeys(writes)))
        elif c.side == "rollout" and any(k in generated for k in c.reads):
            c = dataclasses.replace(c, reads=(*c.reads, MODEL_REWARDS))
        out.append(c)
    reward_inf = Call("reward_inf", "reward", "inference", ("rollouts",), (MODEL_REWARDS,), side="rollout")
    out.insert(1, reward_inf)
    for key in learner_read:
        out.insert(2, Call("reward_credit", "replay", "compute", ("rewards", MODEL_REWARDS), (key,), side="rollout"))
    described = f"{algorithm.description}; rewards from reward models {', '.join(names)}"
    result = dataclasses.replace(algorithm, calls=tuple(out), description=described, reward_models=names)
    result.ordered()  # checked like any graph
    return result


# ---- the shipped graphs ------------------------------------------------------------------------------------------
GENERATE = Call("actor_generate", "actor", "generate", ("prompts",), ("rollouts", "rewards"), side="rollout")
TRAIN = Call("actor_train", "actor", "train", ("rollouts", "advantages"), ("actor",))


def _group_algorithm(estimator: str, description: str) -> Algorithm:
    advantages = Call(f"{estimator}_advantages", "replay", "compute", ("rewards",), ("advantages",), side="rollout")
    return Algorithm(estimator, (GENERATE, advantages, TRAIN), estimator, description)


for _name, _description in (
    ("rloo", "group baseline: each reward minus the mean of the others (REINFORCE leave-one-out)"),
    ("grpo", "group baseline: rewards centred on the group mean and divided by its std"),
    ("dr_grpo", "group baseline: rewards centred on the group mean (Dr.GRPO)"),
    ("reinforce", "REINFORCE with an exponential moving average of rewards as baseline"),
):
    register_algorithm(_group_algorithm(_name, _description))

register_algorithm(
    Algorithm(
        "turn_rloo",
        (
            GENERATE,
            Call("turn_rloo_advantages", "replay", "compute", ("rollouts", "rewards"), ("advantages",), side="rollout"),
            TRAIN,
        ),
        "turn_rloo",
        "per-turn group baseline: each turn's return minus the mean of the others' from the same turn (no critic)",
    )
)

register_algorithm(
    Algorithm(
        "remax",
        (
            GENERATE,
            Call("greedy_generate", "actor", "generate", ("prompts",), ("greedy_rewards",), side="rollout"),
            Call(
                "remax_advantages", "replay", "compute", ("rewards", "greedy_rewards"), ("advantages",), side="rollout"
            ),
            TRAIN,
        ),
        "remax",
        "ReMax: each reward minus the reward of the prompt's greedy completion",
    )
)

TEACHER_LOGPROBS = "teacher_logprobs"
"""The key the `teacher_inf` call writes: the teacher's logprob of each sampled token."""

register_algorithm(
    Algorithm(
        "opd",
        (
            GENERATE,
            Call("teacher_inf", "teacher", "inference", ("rollouts",), (TEACHER_LOGPROBS,), side="rollout"),
            Call("rloo_advantages", "replay", "compute", ("rewards",), ("advantages",), side="rollout"),
            Call("actor_train", "actor", "train", ("rollouts", "advantages", TEACHER_LOGPROBS), ("actor",)),
        ),
        "rloo",
        "on-policy distillation: per-token advantage -(logp_student - logp_teacher) (or the top-k forward KL to the "
        "teacher's top-k, teacher.top_k), plus the task's RLOO advantage weighted by learner.loss.opd_task_coef",
        loss="opd_reverse_kl",
        other_losses=("opd_forward_kl_topk",),
    )
)

register_algorithm(
    Algorithm(
        "ppo",
        (
            Call("actor_generate", "actor", "generate", ("prompts",), ("rollouts", "token_rewards"), side="rollout"),
            Call("critic_inf", "critic", "inference", ("rollouts",), ("values", "bootstrap_values")),
            Call(
                "gae", "critic", "compute", ("token_rewards", "values", "bootstrap_values"), ("advantages", "returns")
            ),
            TRAIN,
            Call("critic_train", "critic", "train", ("rollouts", "values", "returns"), ("critic",)),
        ),
        "gae",
        "PPO: a critic's values, GAE advantages per token, the clipped value loss",
        step=ppo_step,
    )
)
