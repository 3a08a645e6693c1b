"""Train a reward model for an environment: `python -m marin_rl.reward_model --config experiments/NAME.yaml`.

Examples are (prompt, completion, label) triples built from the environment's problems: each problem's reference
completion (`reference_completion`, as the warm start's `reference_examples` uses it) and `negatives_per_problem`
corrupted completions (for a numeric answer: off by ±1, off by ±10 — a dropped or spurious carry, what a policy gets
wrong — or a random number; for any answer: another problem's answer, or one character changed). Every completion
is labelled by the environment's own reward (its verifier), so the labels are the verifier's: a corruption that
happens to be right is a positive. Completions end with EOS, as sampled completions that stopped do.

The model (`marin_rl.model.reward`: the config's LM trunk, random or `model.init_from_hf`, with a zero scalar head)
is trained with binary cross-entropy on the head's output after each completion's last token, classes weighted
equally (`balance_classes`), with AdamW (`optimizer`), on rows packed with several examples each. Three options help a
small model learn within minutes (`experiments/addition_reward_model.yaml` uses them; benchmarks/RESULTS.md has the
measurements): `lm_pretrain_steps` first trains the trunk as a language model on the reference completions (it learns
the task), `extra_layers` then stacks fresh layers on it (they compare its predictions with the tokens that follow),
and `prefix_weight` adds a label to every completion token (whether the completion so far is a prefix of the
reference). Training
examples come from the environment's training problems, with fresh corruptions every pass; held-out accuracy and
AUC (and accuracy per kind of completion) are measured on its held-out problems, which are never trained on. The
checkpoint (`checkpoint_path`, default `output_dir/checkpoint`; local or fsspec URL) is what `reward_models[*].path`
of a run config names; the held-out metrics go to `output_dir/summary.json` and into the checkpoint's spec.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import draccus
import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import numpy as np

from marin_rl.cli_help import preflight
from marin_rl.config import EnvConfig, make_environment
from marin_rl.envs.base import Problem, SingleTurnEnvironment
from marin_rl.envs.rewards import combine_rewards
from marin_rl.learner.loop import Every, Progress, run_steps
from marin_rl.learner.optimizer import OptimizerConfig
from marin_rl.learner.step import apply_gradients
from marin_rl.learner.train_state import TrainState
from marin_rl.logs import configure_logging
from marin_rl.model.build import build_model, parameter_count
from marin_rl.model.config import ModelConfig, with_seq_len
from marin_rl.model.logprobs import token_logprobs
from marin_rl.model.reward import (
    RewardModelSpec,
    last_token_bce,
    last_token_mask,
    reward_model_from,
    save_reward_model,
    with_extra_layers,
)
from marin_rl.model.value import ValueModel
from marin_rl.replay.packing import Sequence, pack, pack_rows
from marin_rl.report import write_summary
from marin_rl.tokenizer import TokenizerConfig, load_tokenizer

logger = logging.getLogger("marin_rl")

NUMERIC_KINDS = ("off_by_1", "off_by_10", "random")
"""Corruptions of a numeric answer."""
GENERIC_KINDS = ("other_answer", "edit")
"""Corruptions of any answer."""


@dataclass
class RewardModelTrainConfig:
    """Training a reward model on an environment's reference completions and corruptions of them."""

    output_dir: str = "runs/addition_reward_model"
    """Directory (local or fsspec URL) for `summary.json` (held-out metrics) and, by default, the checkpoint."""
    checkpoint_path: str | None = None
    """Where the reward-model checkpoint is written (local or fsspec URL); null: `output_dir/checkpoint`."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The trunk: `architecture`, `seed`, and `init_from_hf` to start from a policy's Hugging Face checkpoint."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """The tokenizer (the policy's: the model scores the token ids the policy samples)."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """The environment (`name`, `env_class`, `args`; the other fields are not used): its training problems give the
    training examples, its held-out problems the held-out ones, its reward (`reward_weights`) the labels. Must be a
    single-turn environment with reference completions."""
    negatives_per_problem: int = 3
    """Corrupted completions per problem (each pass draws new ones for the training problems)."""
    corruptions: list[str] = field(default_factory=lambda: ["off_by_1", "off_by_10", "random", "other_answer"])
    """Kinds of corruption, drawn uniformly for each negative among those that apply to the answer: off_by_1,
    off_by_10, random (numeric answers), other_answer (another problem's answer), edit (one character replaced)."""
    lm_pretrain_steps: int = 0
    """Language-model steps on the training problems' reference completions before the reward head is trained (the
    trunk learns the task, as a policy's warm start does; loss on the completion tokens). 0: none."""
    lm_pretrain_learning_rate: float = 3.0e-3
    """Peak learning rate of those steps (AdamW; the other settings are `optimizer`'s)."""
    extra_layers: int = 0
    """Freshly initialised transformer layers added on top of the trunk (after `lm_pretrain_steps` or
    `model.init_from_hf`) before the reward head is trained: they see the trunk's per-position predictions of the next
    token and can compare them with the tokens that follow (one layer compares, a second gathers the comparisons at the
    last token). Needs `scan_layers: true`."""
    prefix_weight: float = 0.0
    """Weight of auxiliary prefix labels: every completion token before the last also gets a label, 1 while the
    completion so far is a prefix of the reference completion and 0 from its first differing token (the reward is
    still the score after the last token, trained on the verifier's label). Assumes one right completion per problem
    (true of the addition task); 0 trains on the last token's label alone."""
    correction_weight: float = 0.0
    """Weight of an auxiliary token-correction loss: a head (initialised from the trunk's LM head, dropped from the
    checkpoint) predicts at each completion token the reference's token there, wherever the completion before it
    agrees with the reference. The trunk predicted that token one position earlier; the loss teaches the extra
    layers to carry that prediction to the token it is compared with. Assumes one right completion per problem."""
    label_threshold: float = 0.5
    """A completion is a positive when the environment's (weighted) reward is at least this."""
    balance_classes: bool = True
    """Weigh examples so that positives and negatives contribute equally to the loss."""
    steps: int = 600
    """Optimizer steps."""
    batch_rows: int = 16
    """Rows per batch; each row packs several examples."""
    row_len: int = 64
    """Tokens per row (also the model's `max_seq_len` at least); longer examples are left out."""
    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(learning_rate=1e-3, warmup_steps=20, weight_decay=0.0)
    )
    """AdamW and its learning-rate schedule."""
    output: str = "sigmoid"
    """How the served reward is made from the head's output: 'sigmoid' (the probability that the completion is
    right, in [0, 1] like a verifier's reward) or 'identity' (the logit)."""
    eval_every: int = 200
    """Measure held-out accuracy every this many steps (and always at the end)."""
    num_eval_problems: int | None = None
    """Use the first this many held-out problems (null: all)."""
    log_every: int = 25
    """Print a progress line every this many steps."""
    seed: int = 0
    """Seed of the corruptions, the example order and the environment."""

    def __post_init__(self):
        unknown = sorted(set(self.corruptions) - set(NUMERIC_KINDS) - set(GENERIC_KINDS))
        if unknown or not self.corruptions:
            raise ValueError(
                f"corruptions must be a non-empty list of {NUMERIC_KINDS + GENERIC_KINDS}, got unknown {unknown}"
                if unknown
                else "corruptions must not be empty"
            )
        for name in ("steps", "batch_rows", "row_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lm_pretrain_steps < 0 or self.extra_layers < 0:
            raise ValueError(
                f"lm_pretrain_steps and extra_layers must be >= 0, got {self.lm_pretrain_steps} and {self.extra_layers}"
            )
        if self.prefix_weight < 0 or self.correction_weight < 0:
            raise ValueError(
                f"prefix_weight and correction_weight must be >= 0, got {self.prefix_weight} and "
                f"{self.correction_weight}"
            )
        if self.negatives_per_problem < 1:
            raise ValueError(f"negatives_per_problem must be >= 1, got {self.negatives_per_problem}")
        if self.output not in ("sigmoid", "identity"):
            raise ValueError(f"output must be 'sigmoid' or 'identity', got {self.output!r}")

    @property
    def checkpoint(self) -> str:
        """Where the checkpoint goes."""
        return self.checkpoint_path or os.path.join(self.output_dir, "checkpoint")


@dataclass
class Example:
    """One labelled completion."""

    prompt_ids: list[int]
    completion_ids: list[int]
    label: float
    kind: str
    """'reference' or the corruption's kind."""
    problem_id: str
    prefix_labels: list[float]
    """Per completion token before the last: whether the completion up to it is a prefix of the reference (empty
    when the problem's reference is itself wrong by the verifier)."""
    reference_ids: list[int]
    """The problem's reference completion (+ EOS), or empty when the verifier finds it wrong."""


def corrupt(answer: str, kind: str, rng: random.Random, others: list[str]) -> str | None:
    """A wrong-looking variant of `answer` of the given kind, or None when the kind does not apply (a numeric kind
    on a non-numeric answer). The verifier decides whether it is actually wrong."""
    text = answer.strip()
    if kind in NUMERIC_KINDS:
        if not text.lstrip("-").isdigit():
            return None
        value = int(text)
        if kind == "random":
            return str(rng.randint(0, max(2 * abs(value), 20)))
        step = 1 if kind == "off_by_1" else 10
        options = [value + d for d in (-step, step) if value + d >= 0 or value < 0]
        return str(rng.choice(options))
    if kind == "other_answer":
        return rng.choice(others) if others else None
    if kind == "edit":
        if not text:
            return None
        i = rng.randrange(len(text))
        pool = "0123456789" if text[i].isdigit() else "abcdefghijklmnopqrstuvwxyz"
        return text[:i] + rng.choice([c for c in pool if c != text[i]] or [pool[0]]) + text[i + 1 :]
    raise ValueError(f"unknown corruption {kind!r}")


class ExampleBuilder:
    """Builds labelled examples for problems of a single-turn environment (see the module docstring)."""

    def __init__(self, env: SingleTurnEnvironment, tokenizer, config: RewardModelTrainConfig):
        if not isinstance(env, SingleTurnEnvironment):
            raise ValueError(
                f"the reward-model trainer needs a single-turn environment; {type(env).__name__} is not "
                "one (multi-turn episodes have no single reference completion to corrupt)"
            )
        self.env = env
        self.tokenizer = tokenizer
        self.config = config
        self.eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]

    def references(self, problems: list[Problem]) -> dict[str, str]:
        """Each problem's reference completion (problems without one are left out)."""
        out = {}
        for p in problems:
            ref = self.env.reference_completion(p)
            if ref is not None:
                out[p.id] = ref
        return out

    def encode(self, completion: str) -> list[int]:
        """Token ids of a completion, ending with EOS as a sampled completion that stopped does."""
        return list(self.tokenizer(completion, add_special_tokens=False)["input_ids"]) + self.eos

    def example(
        self, problem: Problem, prompt_ids: list[int], completion: str, kind: str, reference: str | None
    ) -> Example:
        """`completion` + EOS, labelled by the environment's reward of the decoded completion; its prefixes labelled
        by agreement with `reference` (none without one)."""
        ids = self.encode(completion)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)  # what the env sees of a sampled completion
        rewards = self.env.rewards(problem, prompt_ids, text, ids)
        reward = combine_rewards(rewards, self.env.reward_weights)
        label = float(reward >= self.config.label_threshold)
        if reference is None:
            return Example(prompt_ids, ids, label, kind, problem.id, [], [])
        ref = self.encode(reference)
        prefix = [float(ids[: t + 1] == ref[: t + 1]) for t in range(len(ids) - 1)]
        return Example(prompt_ids, ids, label, kind, problem.id, prefix, ref)

    def build_references(self, problems: list[Problem], references: dict[str, str]) -> list[Example]:
        """The reference completion of every problem that has one."""
        return [
            self.example(p, list(self.env.encode_prompt(p)), references[p.id], "reference", references[p.id])
            for p in problems
            if p.id in references
        ]

    def build(self, problems: list[Problem], references: dict[str, str], rng: random.Random) -> list[Example]:
        """The reference and `negatives_per_problem` corruptions of every problem with a reference."""
        answers = list(dict.fromkeys(references.values()))
        out = []
        for p in problems:
            ref = references.get(p.id)
            if ref is None:
                continue
            prompt_ids = list(self.env.encode_prompt(p))
            reference = self.example(p, prompt_ids, ref, "reference", ref)
            if reference.label < 0.5:  # a wrong reference (an unreliable demonstrator): no per-token labels from it
                reference = self.example(p, prompt_ids, ref, "reference", None)
            out.append(reference)
            dense_from = ref if reference.reference_ids else None
            for _ in range(self.config.negatives_per_problem):
                for _attempt in range(20):
                    kind = rng.choice(self.config.corruptions)
                    text = corrupt(ref, kind, rng, answers)
                    if text is not None and text != ref:
                        out.append(self.example(p, prompt_ids, text, kind, dense_from))
                        break
        return out


def batches_of(examples: list[Example], rows: int, row_len: int, rng: np.random.Generator):
    """Packed batches over one pass of `examples` in a random order: (batch, the examples placed in it, the (row,
    position) of each one's last token)."""
    order = collections.deque(int(i) for i in rng.permutation(len(examples)))
    capacity = rows * row_len
    while order:
        take, tokens = [], 0
        while order and tokens + len(examples[order[0]].prompt_ids) + len(examples[order[0]].completion_ids) <= (
            capacity
        ):
            i = order.popleft()
            take.append(i)
            tokens += len(examples[i].prompt_ids) + len(examples[i].completion_ids)
        if not take:  # cannot happen: examples longer than a row are left out before
            raise RuntimeError("an example longer than a batch")
        seqs = [Sequence.supervised(examples[i].prompt_ids, examples[i].completion_ids) for i in take]
        assignment = pack_rows([len(q) for q in seqs], rows, row_len)
        batch, placed = pack(seqs, rows, row_len, assignment=assignment)
        order.extendleft(reversed([take[j] for j, r in enumerate(assignment) if r is None]))
        fill = [0] * rows
        ends = []  # (row, position) of each placed example's last token: `pack` fills rows in input order
        for j in placed:
            row = assignment[j]
            fill[row] += len(seqs[j])
            ends.append((row, fill[row] - 1))
        yield batch, [examples[take[j]] for j in placed], ends


class RewardModelTrainer:
    """Trains a reward model (see the module docstring)."""

    def __init__(self, config: RewardModelTrainConfig):
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.env = make_environment(config.env, self.tokenizer, seed=config.seed)
        self.builder = ExampleBuilder(self.env, self.tokenizer, config)
        self.rng = random.Random(config.seed)
        self.np_rng = np.random.default_rng(config.seed)
        self.train_problems = self.env.train_problems()
        eval_problems = self.env.eval_problems()[: config.num_eval_problems]
        self.train_refs = self.builder.references(self.train_problems)
        if not self.train_refs:
            raise ValueError(f"environment {self.env.name} has no reference completions to train a reward model on")
        self.eval_examples = self._fit(
            self.builder.build(eval_problems, self.builder.references(eval_problems), random.Random(config.seed + 1)),
            "held-out",
        )
        if not self.eval_examples:
            raise ValueError(f"environment {self.env.name} has no held-out problems with reference completions")
        self.model_config = with_seq_len(config.model, config.row_len)
        self.lm = build_model(self.model_config, len(self.tokenizer))
        """The trunk as a language model (for `lm_pretrain_steps`); the reward model is made from it."""
        self.model: ValueModel = reward_model_from(self.lm)
        self.token_head = None
        """The auxiliary token-correction head (`correction_weight`), trained beside the model, not saved."""
        self.optimizer = config.optimizer.build()
        self.opt_state = None
        self._step = eqx.filter_jit(self._step_impl, donate="all-except-first")
        self._logits = eqx.filter_jit(self._logits_impl)

    def _fit(self, examples: list[Example], what: str) -> list[Example]:
        kept = [e for e in examples if len(e.prompt_ids) + len(e.completion_ids) <= self.config.row_len]
        if len(kept) < len(examples):
            logger.warning(
                "reward model: %d of %d %s examples are longer than row_len=%d and are left out",
                len(examples) - len(kept),
                len(examples),
                what,
                self.config.row_len,
            )
        return kept

    # ---- the jitted calls ---------------------------------------------------------------------------------------
    @staticmethod
    def _named(batch, *extra: np.ndarray):
        Batch, Pos = hax.Axis("batch", batch.input_ids.shape[0]), hax.Axis("position", batch.input_ids.shape[1])
        arrays = (batch.input_ids, batch.position_ids, batch.segment_ids, *extra)
        return [hax.named(jnp.asarray(a), (Batch, Pos)) for a in arrays]

    def _step_impl(
        self, state, opt_state, input_ids, position_ids, segment_ids, is_last, labels, weights, targets, mask
    ):
        def loss_fn(st):
            model, token_head = st
            return last_token_bce(
                model,
                input_ids,
                position_ids,
                segment_ids,
                is_last,
                labels,
                weights,
                token_head=token_head,
                token_targets=targets,
                token_mask=mask,
                token_weight=self.config.correction_weight,
            )

        (_, metrics), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(state)
        state, opt_state, grad_norm = apply_gradients(state, grads, opt_state, self.optimizer)
        return state, opt_state, {**metrics, "grad_norm": grad_norm}

    def _logits_impl(self, model, input_ids, position_ids, segment_ids):
        return model.hidden_values(input_ids, position_ids, segment_ids).array

    @staticmethod
    def train_arrays(
        batch,
        placed: list[Example],
        ends: list[tuple[int, int]],
        class_weights: dict[float, float],
        prefix_weight: float = 0.0,
    ) -> tuple[np.ndarray, ...]:
        """(is_last, labels, weights, correction targets, correction mask) of a packed batch, (rows, positions)
        each: every example's label and class weight at its last token; with `prefix_weight` > 0 its prefix labels at
        its other completion tokens; at each completion token where the completion before it agrees with the
        reference, the reference's token there (for `correction_weight`)."""
        is_last = last_token_mask(batch.segment_ids)
        labels = np.zeros(is_last.shape, np.float32)
        weights = np.zeros(is_last.shape, np.float32)
        targets = np.zeros(is_last.shape, np.int32)
        mask = np.zeros(is_last.shape, np.float32)
        for (r, c), ex in zip(ends, placed, strict=True):
            if not is_last[r, c]:
                raise RuntimeError(f"packing: position ({r}, {c}) is not the end of a sequence")
            labels[r, c] = ex.label
            weights[r, c] = class_weights[ex.label]
            first = c - len(ex.completion_ids) + 1  # the completion's first token
            if prefix_weight > 0 and ex.prefix_labels:
                labels[r, first:c] = ex.prefix_labels
                weights[r, first:c] = prefix_weight
            for j, ref_token in enumerate(ex.reference_ids[: len(ex.completion_ids)]):
                if ex.completion_ids[:j] != ex.reference_ids[:j]:
                    break
                targets[r, first + j] = ref_token
                mask[r, first + j] = 1.0
        return is_last, labels, weights, targets, mask

    # ---- the trunk ----------------------------------------------------------------------------------------------
    def pretrain_lm(self) -> dict[str, float]:
        """`lm_pretrain_steps` language-model steps on the training problems' reference completions (loss on the
        completion tokens); returns the first and last losses."""
        cfg = self.config
        optimizer = dataclasses.replace(cfg.optimizer, learning_rate=cfg.lm_pretrain_learning_rate).build()
        opt_state = optimizer.init(eqx.filter(self.lm, eqx.is_inexact_array))

        def loss_fn(lm, input_ids, position_ids, segment_ids, mask):
            logprobs, _ = token_logprobs(lm, input_ids, position_ids, segment_ids)
            return -(hax.sum(logprobs * mask) / hax.maximum(hax.sum(mask), 1.0)).array

        @eqx.filter_jit
        def step(lm, opt_state, *arrays):
            loss, grads = eqx.filter_value_and_grad(loss_fn)(lm, *arrays)
            lm, opt_state, _ = apply_gradients(lm, grads, opt_state, optimizer)
            return lm, opt_state, loss

        references = [
            e
            for e in self._fit(self.builder.build_references(self.train_problems, self.train_refs), "training")
            if e.label > 0.5
        ]
        if not references:
            raise ValueError(f"lm_pretrain_steps: no reference completion of {self.env.name} is a positive")
        losses, start = [], time.time()

        def reference_batches():
            while True:
                yield from batches_of(references, cfg.batch_rows, cfg.row_len, self.np_rng)

        def lm_step(state, item):
            batch, _, _ = item
            arrays = self._named(batch, batch.loss_mask.astype(np.float32))
            lm, opt_state, loss = step(state.model, state.opt_state, *arrays)
            self.lm = lm  # the trainer holds the trunk (its old arrays are freed)
            return state.replace(model=lm, opt_state=opt_state), {"loss": loss}

        def log_line(n, _state, _metrics):
            recent = float(np.mean(losses[-cfg.log_every :]))
            logger.info(
                "reward model: language-model step %d/%d | loss %.4f | %.0fs",
                n,
                cfg.lm_pretrain_steps,
                recent,
                time.time() - start,
            )

        run_steps(
            TrainState(self.lm, opt_state),
            reference_batches(),
            lm_step,
            total=cfg.lm_pretrain_steps,
            every=[
                Every(1, lambda _n, _state, metrics: losses.append(float(metrics["loss"]))),
                Every(cfg.log_every, log_line),
            ],
            progress=Progress("reward model: language model", lambda _: f"loss {losses[-1]:.4f}"),
        )
        return {"lm_loss_first": losses[0], "lm_loss_last": losses[-1], "lm_seconds": time.time() - start}

    def prepare_trunk(self) -> dict[str, float]:
        """Language-model pretraining and extra layers as configured; then the reward model (zero head) on the
        trunk, and its optimizer state."""
        out = self.pretrain_lm() if self.config.lm_pretrain_steps > 0 else {}
        if self.config.extra_layers > 0:
            self.lm, self.model_config = with_extra_layers(self.lm, self.model_config, self.config.extra_layers)
        self.model = reward_model_from(self.lm)
        if self.config.correction_weight > 0:  # it reads what the trunk predicts, as the LM head does
            self.token_head = jnp.copy(self.lm.get_lm_head().array)
            self.token_head = hax.named(self.token_head, self.lm.get_lm_head().axes)
        self.lm = None  # the reward model holds a copy of the trunk
        self.opt_state = self.optimizer.init(eqx.filter((self.model, self.token_head), eqx.is_inexact_array))
        return out

    # ---- evaluation -------------------------------------------------------------------------------------------
    def scores(self, examples: list[Example]) -> np.ndarray:
        """The head's output (logit) after each example's last token, in the order of `examples`."""
        out = np.zeros(len(examples), np.float32)
        index = {id(e): i for i, e in enumerate(examples)}
        rng = np.random.default_rng(0)
        for batch, placed, ends in batches_of(examples, self.config.batch_rows, self.config.row_len, rng):
            logits = np.asarray(self._logits(self.model, *self._named(batch)))
            for (r, c), ex in zip(ends, placed, strict=True):
                out[index[id(ex)]] = logits[r, c]
        return out

    def evaluate(self) -> dict[str, Any]:
        """Held-out accuracy (threshold: probability 0.5), AUC, and accuracy per kind of completion."""
        logits = self.scores(self.eval_examples)
        labels = np.array([e.label for e in self.eval_examples])
        predicted = logits > 0
        out: dict[str, Any] = {
            "accuracy": float(np.mean(predicted == (labels > 0.5))),
            "auc": auc(logits, labels),
            "examples": len(labels),
            "positives": int(np.sum(labels > 0.5)),
        }
        pos, neg = labels > 0.5, labels <= 0.5
        out["balanced_accuracy"] = (
            float(0.5 * (np.mean(predicted[pos]) + np.mean(~predicted[neg])))
            if (pos.any() and neg.any())
            else out["accuracy"]
        )
        for kind in sorted({e.kind for e in self.eval_examples}):
            idx = [i for i, e in enumerate(self.eval_examples) if e.kind == kind]
            out[f"accuracy/{kind}"] = float(np.mean(predicted[idx] == (labels[idx] > 0.5)))
        return out

    # ---- the loop ---------------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Train for `steps`, evaluating every `eval_every`; write the checkpoint and the summary; returns it."""
        cfg = self.config
        start = time.time()
        pretraining = self.prepare_trunk()
        logger.info(
            "reward model: %s parameters; %d training problems, %d held-out examples (%d positive)",
            f"{parameter_count(self.model):,}",
            len(self.train_refs),
            len(self.eval_examples),
            sum(e.label > 0.5 for e in self.eval_examples),
        )
        before = self.evaluate()
        logger.info("reward model: held-out accuracy %.3f, AUC %.3f before training", before["accuracy"], before["auc"])
        history, last_eval, passes = [], before, 0
        window: dict[str, list[float]] = collections.defaultdict(list)

        def labelled_batches():  # each pass: fresh negatives, class weights, then its batches
            nonlocal passes
            while True:
                examples = self._fit(self.builder.build(self.train_problems, self.train_refs, self.rng), "training")
                positives = sum(e.label > 0.5 for e in examples)
                frac = positives / len(examples)
                class_weights = {1.0: 1.0, 0.0: 1.0}
                if cfg.balance_classes and 0 < positives < len(examples):
                    class_weights = {1.0: 0.5 / frac, 0.0: 0.5 / (1 - frac)}
                passes += 1
                for batch, placed, ends in batches_of(examples, cfg.batch_rows, cfg.row_len, self.np_rng):
                    yield batch, placed, ends, class_weights

        def train_step(state, item):
            batch, placed, ends, class_weights = item
            t = time.time()
            arrays = self.train_arrays(batch, placed, ends, class_weights, cfg.prefix_weight)
            params, opt_state, metrics = self._step(state.model, state.opt_state, *self._named(batch, *arrays))
            (self.model, self.token_head), self.opt_state = params, opt_state  # what `evaluate` reads
            for k, v in metrics.items():
                window[k].append(float(v))
            window["step_time_s"].append(time.time() - t)
            row = {"step": len(history) + 1, "pass": passes, **{k: float(v) for k, v in metrics.items()}}
            return state.replace(model=params, opt_state=opt_state), row

        def evaluate(_step, _state, row):
            nonlocal last_eval
            last_eval = self.evaluate()
            row.update({f"eval/{k}": v for k, v in last_eval.items()})

        def log_line(step, _state, row):
            loss, acc, secs = (float(np.mean(window[k])) for k in ("loss", "accuracy", "step_time_s"))
            line = f"reward model step {step:>5}/{cfg.steps} | loss {loss:.4f} | train acc {acc:.3f}"
            if "token_ce" in window:
                line += f" | token ce {float(np.mean(window['token_ce'])):.3f}"
            line += f" | {secs:.3f}s/step"
            if "eval/accuracy" in row:
                line += f" | held-out acc {row['eval/accuracy']:.3f} AUC {row['eval/auc']:.3f}"
            logger.info(line)
            window.clear()

        _, step = run_steps(
            TrainState((self.model, self.token_head), self.opt_state),
            labelled_batches(),
            train_step,
            total=cfg.steps,
            every=[
                Every(cfg.eval_every, evaluate),
                Every(1, lambda _step, _state, row: history.append(row)),
                Every(cfg.log_every, log_line),
            ],
            progress=Progress("reward model", lambda row: f"loss {row['loss']:.4f}"),  # a bar, or a line every 30 s
        )
        seconds = time.time() - start
        summary = {
            "mode": "reward_model",
            "environment": self.env.name,
            "steps": step,
            "passes": passes,
            "parameters": parameter_count(self.model),
            "eval_before": before,
            **pretraining,
            "eval": last_eval,
            "train_seconds": seconds,
            "checkpoint": cfg.checkpoint,
        }
        spec = RewardModelSpec(
            model=self.model_config,
            vocab_size=len(self.tokenizer),
            tokenizer=cfg.tokenizer,
            output=cfg.output,
            info={
                "trained_by": "marin_rl.reward_model",
                "environment": self.env.name,
                "env_class": cfg.env.env_class,
                "steps": step,
                "eval": last_eval,
            },
        )
        save_reward_model(self.model, spec, cfg.checkpoint)
        write_summary(cfg.output_dir, summary)
        _write_history(cfg.output_dir, history)
        logger.info(
            "reward model: held-out accuracy %.3f -> %.3f, AUC %.3f -> %.3f in %.0fs; checkpoint at %s",
            before["accuracy"],
            last_eval["accuracy"],
            before["auc"],
            last_eval["auc"],
            seconds,
            cfg.checkpoint,
        )
        return summary


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve: the probability that a random positive scores above a random negative (ties
    count half); 0.5 when one class is missing."""
    pos, neg = scores[labels > 0.5], scores[labels <= 0.5]
    if len(pos) == 0 or len(neg) == 0:
        return 0.5
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(pos) * len(neg)))


def _write_history(output_dir: str, history: list[dict]) -> None:
    import fsspec

    with fsspec.open(os.path.join(output_dir, "metrics.jsonl"), "w") as f:
        for row in history:
            f.write(json.dumps(row) + "\n")


def parse_config(args: list[str] | None = None) -> RewardModelTrainConfig:
    """`--config FILE` plus dotted overrides (default: the command line); exits with a message naming a bad key."""
    args = list(sys.argv[1:] if args is None else args)
    example = ("experiments/addition_reward_model.yaml", "--steps 100 --output_dir runs/short_rm")
    preflight(RewardModelTrainConfig, args, "python -m marin_rl.reward_model", example)  # --help, unknown keys
    config_path = None
    for i, a in enumerate(args):
        if a == "--config" and i + 1 < len(args):
            config_path = args[i + 1]
            del args[i : i + 2]
            break
        if a.startswith("--config="):
            config_path = a.split("=", 1)[1]
            del args[i]
            break
    try:
        return draccus.parse(RewardModelTrainConfig, config_path=config_path, args=args)
    except (draccus.utils.DecodingError, FileNotFoundError) as e:
        raise SystemExit(f"marin_rl.reward_model: invalid configuration: {e}") from None
    except draccus.utils.ParsingError as e:
        raise SystemExit(f"marin_rl.reward_model: invalid configuration: {e.__cause__ or e}") from None


def train_reward_model(config: RewardModelTrainConfig) -> dict[str, Any]:
    """Train and save a reward model (see the module docstring); returns the summary."""
    configure_logging()
    return RewardModelTrainer(config).train()


def main(args: list[str] | None = None) -> None:
    """Command-line entry point."""
    summary = train_reward_model(parse_config(args))
    ev = summary["eval"]
    print(
        f"held-out accuracy {ev['accuracy']:.3f} (balanced {ev['balanced_accuracy']:.3f}), AUC {ev['auc']:.3f} on "
        f"{ev['examples']} examples; checkpoint: {summary['checkpoint']}"
    )


if __name__ == "__main__":
    main()
