"""Supervised fine-tuning (`learner.mode: sft`): train the policy on prompt/completion records, for warm starts.

    python -m marin_rl.run --config experiments/sft_addition.yaml      (`learner.mode: sft`)

The records (JSONL or Parquet, local or `gs://`, read through fsspec like the environments' data) are tokenized with
the run's tokenizer, packed several to a row into `batcher.max_seq_len`-token rows exactly like RL batches (segment
ids, loss mask on the completion tokens only), and trained with the learner's model, mesh and supervised step (the
same step as the RL run's warm start) for `learner.sft.steps` steps or `learner.sft.epochs` passes. The held-out loss
is evaluated before the first step, every `eval_every` steps and after the last; metrics go to the run's tracker
(`output_dir/metrics.jsonl`, W&B when enabled). The policy is exported as a Hugging Face checkpoint to
`output_dir/hf/step-N` every `model.export_every` steps and at the end, so that an RL run can start from it with
`model.init_from_hf`. No Ray, inference server or environment is involved.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import time
from dataclasses import asdict
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from marin_rl.config import RunConfig
from marin_rl.envs.data import DataFormatError, read_rows, text_field
from marin_rl.learner.config import SftConfig
from marin_rl.learner.learner import Learner
from marin_rl.learner.loop import Every, Progress, run_steps
from marin_rl.logs import configure_logging
from marin_rl.model.config import with_seq_len
from marin_rl.replay.packing import Sequence, pack, pack_rows
from marin_rl.report import write_summary
from marin_rl.tokenizer import load_tokenizer
from marin_rl.tracking import make_tracker
from marin_rl.types import PackedBatch

logger = logging.getLogger("marin_rl")

Record = tuple[str, str, str]
"""(location for messages, prompt text, completion text)."""
Example = tuple[list[int], list[int]]
"""(prompt token ids, completion token ids)."""


def load_records(files: list[str], prompt_field: str, completion_field: str) -> list[Record]:
    """The prompt/completion records of JSONL or Parquet files (paths, fsspec URLs or globs), in file order.

    Raises `DataFormatError` naming the file, the line or row, and the field when a record lacks a field or holds
    something other than text there.
    """
    records = []
    for path in files:
        for where, row in read_rows(path):
            texts = [text_field(row, name, where, allow_empty=True) for name in (prompt_field, completion_field)]
            records.append((where, texts[0], texts[1]))
    return records


def encode_records(
    records: list[Record], tokenizer: PreTrainedTokenizerBase, *, chat_template: bool, append_eos: bool
) -> list[Example]:
    """Token ids of each record's prompt and completion.

    Plain records: the prompt and the completion are tokenized separately without special tokens (as environments
    encode prompts and as the sampler emits completions), plus EOS after the completion when `append_eos`. With
    `chat_template` the prompt is the chat template's rendering of a user turn with the generation prompt, and the
    completion is the rest of its rendering of the user turn followed by an assistant turn.
    """
    if not records:
        return []
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("learner.sft.chat_template is true, but the tokenizer has no chat template")
        return [_encode_chat(tokenizer, where, p, c) for where, p, c in records]
    eos = tokenizer.eos_token_id
    if append_eos and eos is None:
        raise ValueError("learner.sft.append_eos is true, but the tokenizer has no EOS token")
    prompts = tokenizer([p for _, p, _ in records], add_special_tokens=False)["input_ids"]
    completions = tokenizer([c for _, _, c in records], add_special_tokens=False)["input_ids"]
    out = []
    for (where, _, _), p, c in zip(records, prompts, completions, strict=True):
        c = list(c) + ([eos] if append_eos else [])
        if not c:
            raise DataFormatError(f"{where}: the completion is empty (nothing to train on)")
        out.append((list(p), c))
    return out


def _encode_chat(tokenizer: PreTrainedTokenizerBase, where: str, prompt: str, completion: str) -> Example:
    user = [{"role": "user", "content": prompt}]
    prompt_ids = list(tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True))
    full = list(tokenizer.apply_chat_template(user + [{"role": "assistant", "content": completion}], tokenize=True))
    if full[: len(prompt_ids)] != prompt_ids or len(full) == len(prompt_ids):
        raise DataFormatError(
            f"{where}: the chat template's rendering of the conversation does not start with its rendering of the "
            "prompt (with the generation prompt), so the completion tokens cannot be told apart"
        )
    return prompt_ids, full[len(prompt_ids) :]


def split_held_out(examples: list, fraction: float, seed: int) -> tuple[list, list]:
    """A seeded shuffle of `examples` split into (train, held out): `fraction` of them held out, at least one each."""
    if len(examples) < 2:
        raise ValueError(f"learner.sft: need at least 2 records to hold some out, got {len(examples)}")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_eval = min(max(1, round(fraction * len(examples))), len(examples) - 1)
    return [examples[i] for i in order[n_eval:]], [examples[i] for i in order[:n_eval]]


def plan_batches(
    lengths: list[int], rows: int, row_len: int, *, epochs: int = 1, steps: int = 0, seed: int = 0
) -> list[list[tuple[int, int]]]:
    """Which sequences go into which row of each batch: a list of batches of `(sequence index, row)` pairs.

    Every pass (epoch) visits all sequences once in a fresh seeded order. Each batch takes the next sequences of the
    pass until their tokens exceed 1.5 × the batch's `rows × row_len` (some choice for the packer), assigns rows with
    `pack_rows` (first-/best-fit decreasing, as the RL batcher does) and returns what did not fit to the front of the
    queue, so batches are nearly full and no sequence is skipped. A batch never mixes two passes. With `steps > 0`
    passes are added until there are `steps` batches (then `epochs` is ignored); otherwise there are `epochs` passes.
    """
    if any(n > row_len for n in lengths):
        raise ValueError(f"sequences longer than the row length {row_len} cannot be packed")
    if not lengths:
        raise ValueError("no sequences to plan batches for")
    rng = np.random.default_rng(seed)
    capacity = rows * row_len
    batches: list[list[tuple[int, int]]] = []
    passes = 0
    while (steps > 0 and len(batches) < steps) or (steps == 0 and passes < epochs):
        queue = collections.deque(int(i) for i in rng.permutation(len(lengths)))
        while queue:
            take, tokens = [], 0
            while queue and tokens <= 1.5 * capacity:
                take.append(queue.popleft())
                tokens += lengths[take[-1]]
            assignment = pack_rows([lengths[i] for i in take], rows, row_len)
            placed = [(i, r) for i, r in zip(take, assignment, strict=True) if r is not None]
            if not placed:  # cannot happen: an empty batch always has room for one sequence
                raise RuntimeError("packing placed no sequence in an empty batch")
            queue.extendleft(reversed([i for i, r in zip(take, assignment, strict=True) if r is None]))
            batches.append(placed)
        passes += 1
    return batches[:steps] if steps > 0 else batches


def build_batch(sequences: list[Sequence], plan: list[tuple[int, int]], rows: int, row_len: int) -> PackedBatch:
    """The packed batch of one planned batch (see `plan_batches`)."""
    batch, _ = pack([sequences[i] for i, _ in plan], rows, row_len, assignment=[r for _, r in plan])
    return batch


class SftTrainer:
    """Supervised fine-tuning of the run's policy on prompt/completion records (see the module docstring)."""

    def __init__(self, config: RunConfig):
        self.config = config
        cfg: SftConfig = config.learner.sft
        self.cfg = cfg
        self.row_len = config.batcher.max_seq_len
        self.tokenizer = load_tokenizer(config.tokenizer)
        t = time.time()
        train = self._load(cfg.train_files, "learner.sft.train_files")
        if cfg.eval_files:
            held_out = self._load(cfg.eval_files, "learner.sft.eval_files")
        else:
            train, held_out = split_held_out(train, cfg.eval_fraction, cfg.seed)
        if cfg.max_eval_records is not None:
            held_out = held_out[: cfg.max_eval_records]
        self.train_seqs = [Sequence.supervised(p, c) for p, c in train]
        self.eval_seqs = [Sequence.supervised(p, c) for p, c in held_out]
        logger.info(
            "sft: %d training and %d held-out records (%.1fs to load and tokenize)",
            len(self.train_seqs),
            len(self.eval_seqs),
            time.time() - t,
        )
        self.learner = Learner(with_seq_len(config.model, self.row_len), config.learner, len(self.tokenizer))
        if cfg.batch_rows % self.learner.batch_shards != 0:
            raise ValueError(
                f"learner.sft.batch_rows={cfg.batch_rows} does not split over the learner mesh's "
                f"{self.learner.batch_shards} batch shards; choose a multiple of {self.learner.batch_shards}"
            )
        self.optimizer = cfg.optimizer.build()
        self.learner.opt_state = None  # the RL optimizer is not used here: free its memory before building SFT's
        self.learner.opt_state = self.learner.supervised_optimizer_state(self.optimizer)
        """The learner's train state holds the SFT optimizer's state (`learner.opt_state`) in place of the RL one's."""
        self.plan = plan_batches(
            [len(s) for s in self.train_seqs],
            cfg.batch_rows,
            self.row_len,
            epochs=cfg.epochs,
            steps=cfg.steps,
            seed=cfg.seed,
        )
        self.eval_plan = plan_batches([len(s) for s in self.eval_seqs], cfg.batch_rows, self.row_len, seed=cfg.seed)
        self.step = 0

    def _load(self, files: list[str], what: str) -> list[Example]:
        cfg = self.cfg
        records = load_records(files, cfg.prompt_field, cfg.completion_field)
        if not records:
            raise ValueError(f"{what}: no records in {files}")
        examples = encode_records(records, self.tokenizer, chat_template=cfg.chat_template, append_eos=cfg.append_eos)
        kept = [e for e in examples if len(e[0]) + len(e[1]) <= self.row_len]
        if len(kept) < len(examples):
            longest = max(len(p) + len(c) for p, c in examples)
            logger.warning(
                "sft: %s: %d of %d records are longer than batcher.max_seq_len=%d tokens (longest %d) and are left out",
                what,
                len(examples) - len(kept),
                len(examples),
                self.row_len,
                longest,
            )
        if not kept:
            raise ValueError(f"{what}: every record is longer than batcher.max_seq_len={self.row_len} tokens")
        return kept

    def evaluate(self) -> dict[str, float]:
        """Held-out loss: mean negative log-likelihood per completion token over all held-out records."""
        total, count = 0.0, 0
        for plan in self.eval_plan:
            s, n = self.learner.supervised_nll(build_batch(self.eval_seqs, plan, self.cfg.batch_rows, self.row_len))
            total, count = total + s, count + n
        return {"sft/eval_loss": total / max(count, 1), "sft/eval_tokens": float(count)}

    def export(self) -> str:
        """Save the policy as a Hugging Face checkpoint at `output_dir/hf/step-N`."""
        path = os.path.join(self.config.output_dir, "hf", f"step-{self.step}")
        self.learner.export_hf(path, self.tokenizer)
        logger.info("sft: exported the policy as a Hugging Face checkpoint to %s", path)
        return path

    def train(self) -> dict[str, Any]:
        """Train through the planned batches; returns the summary (also written to `output_dir/summary.json`)."""
        config = self.config
        run_name = config.tracking.run_name or os.path.basename(os.path.normpath(config.output_dir))
        tracker, _ = make_tracker(
            config.output_dir, config.tracking.wandb_mode, config.tracking.wandb_project, run_name
        )
        try:
            tracker.log_hyperparameters(asdict(config))
            return self._train(tracker)
        finally:
            tracker.finish()

    def _train(self, tracker) -> dict[str, Any]:
        config, cfg = self.config, self.cfg
        num_steps = len(self.plan)
        logger.info(
            "sft: %d steps of %d rows × %d tokens, %s parameters",
            num_steps,
            cfg.batch_rows,
            self.row_len,
            f"{self.learner.num_params:,}",
        )
        start = time.time()
        eval_start = self.evaluate()
        tracker.log(eval_start, step=0)
        logger.info("sft: held-out loss before training %.4f", eval_start["sft/eval_loss"])
        totals = {"last_eval": eval_start, "exported": None, "trained_tokens": 0, "seen": 0}

        def step(state, plan):
            t = time.time()
            batch = build_batch(self.train_seqs, plan, cfg.batch_rows, self.row_len)
            state, device_metrics = self.learner.supervised_state_step(state, batch, self.optimizer)
            self.learner.train_state = state  # the learner holds the policy (its old arrays are freed)
            self.step += 1
            totals["seen"] += len(plan)
            metrics = {f"sft/{k}": float(v) for k, v in device_metrics.items()}
            elapsed = time.time() - t
            totals["trained_tokens"] += int(metrics["sft/tokens"])
            metrics.update(
                {
                    "sft/learning_rate": cfg.optimizer.lr_at(self.step - 1),
                    "sft/epoch": totals["seen"] / len(self.train_seqs),
                    "sft/step_time_s": elapsed,
                    "sft/tokens_per_s": float(np.sum(batch.segment_ids >= 0)) / max(elapsed, 1e-9),
                    "sft/packing_efficiency": float(np.mean(batch.segment_ids >= 0)),
                }
            )
            return state, metrics

        def evaluate(_step, _state, metrics):
            totals["last_eval"] = self.evaluate()
            metrics.update(totals["last_eval"])

        def export(_step, _state, _metrics):
            totals["exported"] = self.export()

        def log_line(_step, _state, metrics):
            line = f"sft step {self.step:>5}/{num_steps} | loss {metrics['sft/loss']:.4f}"
            if "sft/eval_loss" in metrics:
                line += f" | eval {metrics['sft/eval_loss']:.4f}"
            line += f" | epoch {metrics['sft/epoch']:.2f} | {metrics['sft/tokens_per_s']:.0f} tok/s"
            logger.info(line)

        self.learner.train_state, _ = run_steps(
            self.learner.train_state,
            self.plan,
            step,
            total=num_steps,
            every=[
                Every(cfg.eval_every, evaluate),
                Every(config.model.export_every, export),
                Every(1, lambda step, _state, metrics: tracker.log(metrics, step=step)),
                Every(cfg.log_every, log_line),
            ],
            progress=Progress("sft", lambda metrics: f"loss {metrics['sft/loss']:.4f}"),  # a bar, or a line every 30 s
        )
        last_eval, exported, trained_tokens = totals["last_eval"], totals["exported"], totals["trained_tokens"]
        summary = {
            "mode": "sft",
            "steps": self.step,
            "train_records": len(self.train_seqs),
            "eval_records": len(self.eval_seqs),
            "trained_tokens": trained_tokens,
            "eval_loss_start": eval_start["sft/eval_loss"],
            "eval_loss_end": last_eval["sft/eval_loss"],
            "final_checkpoint": exported,
            "wall_time_s": time.time() - start,
        }
        tracker.log_summary(summary)
        write_summary(config.output_dir, summary)
        logger.info(
            "sft: held-out loss %.4f -> %.4f; policy at %s",
            summary["eval_loss_start"],
            summary["eval_loss_end"],
            exported,
        )
        return summary


def run_sft(config: RunConfig) -> dict[str, Any]:
    """Run supervised fine-tuning (`learner.mode: sft`) end to end; returns the summary."""
    if config.learner.mode != "sft":
        raise ValueError(f"run_sft needs learner.mode 'sft', got {config.learner.mode!r}")
    configure_logging()
    config.configure_jax()
    return SftTrainer(config).train()
