"""Reward models: a Levanter LM trunk with a scalar head (the critic's `ValueModel`), scoring whole sequences.

A sequence's reward is the head's output after its last token, passed through the checkpoint's `output` transform
('sigmoid' for a model trained with binary cross-entropy: the reward is the probability that the completion is
correct; 'identity': the raw head output). `sequence_rewards` scores padded rows (one sequence per row, the serving
layout); `last_token_bce` is the training loss on packed rows (several sequences per row, segment ids).

A checkpoint is a directory (local path or fsspec URL such as `gs://`):

* `weights.eqx` — the model's arrays, serialised with equinox (`tree_serialise_leaves`), written first;
* `reward_model.json` — the model config (architecture as the run config names it), vocabulary size, tokenizer spec,
  output transform and free-form `info` (how it was trained, its held-out metrics), written last: a directory without
  it is not (or not yet) a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import draccus
import equinox as eqx
import fsspec
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from levanter.models.lm_model import LmHeadModel

from marin_rl.model.build import build_model, resolved_architecture
from marin_rl.model.config import ModelConfig
from marin_rl.model.logprobs import packed_attention_mask
from marin_rl.model.value import ValueModel, value_model_from
from marin_rl.tokenizer import TokenizerConfig

SPEC_FILE = "reward_model.json"
"""The config of a reward-model checkpoint (written last: its completion marker)."""
WEIGHTS_FILE = "weights.eqx"
"""The arrays of a reward-model checkpoint."""
FORMAT = 1
OUTPUTS = ("sigmoid", "identity")
"""How the head's output after the last token becomes the reward."""


@dataclass
class RewardModelSpec:
    """What a reward-model checkpoint holds beside its weights."""

    model: ModelConfig
    """The trunk's architecture (`model.architecture`, a Levanter LM config chosen by `type:`)."""
    vocab_size: int
    """Rows of the trunk's embedding: token ids must be below it."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """The tokenizer whose ids the model reads (as the run config names it)."""
    output: str = "sigmoid"
    """'sigmoid': reward = sigmoid(head output), a probability (models trained with binary cross-entropy);
    'identity': reward = head output."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form: how the model was trained, its held-out metrics."""

    def __post_init__(self):
        if self.output not in OUTPUTS:
            raise ValueError(f"reward model output must be one of {OUTPUTS}, got {self.output!r}")
        if self.vocab_size < 1:
            raise ValueError(f"reward model vocab_size must be >= 1, got {self.vocab_size}")

    @property
    def max_seq_len(self) -> int:
        """The longest sequence the model scores (its architecture's `max_seq_len`)."""
        return int(self.model.architecture.max_seq_len)


def new_reward_model(config: ModelConfig, vocab_size: int) -> ValueModel:
    """A reward model whose trunk is `config`'s model (random, or `init_from_hf`) and whose head is zero."""
    return reward_model_from(build_model(config, vocab_size))


def reward_model_from(policy: LmHeadModel) -> ValueModel:
    """A reward model whose trunk is a copy of `policy`'s (LM head dropped) and whose head is zero."""
    return value_model_from(policy)


def apply_output(scores: hax.NamedArray | jnp.ndarray, output: str):
    """The reward from the head's output: sigmoid or identity (`RewardModelSpec.output`)."""
    if output == "sigmoid":
        return hax.nn.sigmoid(scores) if isinstance(scores, hax.NamedArray) else jax.nn.sigmoid(scores)
    if output == "identity":
        return scores
    raise ValueError(f"reward model output must be one of {OUTPUTS}, got {output!r}")


def sequence_scores(model: ValueModel, input_ids: hax.NamedArray, lengths: hax.NamedArray) -> hax.NamedArray:
    """The head's output after the last token of each row: rows of `input_ids` (axes `batch`, `position`) hold one
    sequence each, left-aligned, its first `lengths[row]` tokens real (the rest padding, which causal attention keeps
    from affecting them). Returns float32 over `batch`."""
    Pos = input_ids.resolve_axis("position")
    position_ids = hax.broadcast_to(hax.arange(Pos), input_ids.axes)
    segment_ids = hax.where(position_ids < lengths, 0, -1).astype(jnp.int32)
    values = model.hidden_values(input_ids, position_ids, segment_ids)
    return hax.sum(hax.where(position_ids == lengths - 1, values, 0.0), Pos)


def sequence_rewards(
    model: ValueModel, input_ids: hax.NamedArray, lengths: hax.NamedArray, output: str = "sigmoid"
) -> hax.NamedArray:
    """`sequence_scores` through the output transform: each row's reward."""
    return apply_output(sequence_scores(model, input_ids, lengths), output)


def last_token_mask(segment_ids: np.ndarray) -> np.ndarray:
    """(rows, positions) bool: true at the last token of every segment of packed rows (padding: segment id -1)."""
    seg = np.asarray(segment_ids)
    following = np.concatenate([seg[:, 1:], np.full((seg.shape[0], 1), -2, seg.dtype)], axis=1)
    return (seg >= 0) & (following != seg)


def last_token_bce(
    model: ValueModel,
    input_ids: hax.NamedArray,
    position_ids: hax.NamedArray,
    segment_ids: hax.NamedArray,
    is_last: hax.NamedArray,
    labels: hax.NamedArray,
    weights: hax.NamedArray,
    *,
    token_head: hax.NamedArray | None = None,
    token_targets: hax.NamedArray | None = None,
    token_mask: hax.NamedArray | None = None,
    token_weight: float = 0.0,
) -> tuple[jnp.ndarray, dict[str, jnp.ndarray]]:
    """The reward model's training loss on packed rows: binary cross-entropy of the head's output (a logit) against
    `labels` (0 or 1, or a probability), a `weights`-weighted mean over positions. The last token of every sequence
    (`is_last`) carries its sequence's label; other positions may carry labels of their own (weight > 0) or none.

    With `token_head` (Embed × Vocab, e.g. an LM head) and `token_weight` > 0, plus `token_weight` × the mean
    cross-entropy of `token_head`'s logits at the positions of `token_mask` against `token_targets` (an auxiliary
    token-prediction loss on the same hidden states). Returns (loss, metrics: the BCE 'loss', and over the last tokens
    the weighted 'accuracy' at threshold 0.5 and 'mean_probability'; 'token_ce' when the auxiliary loss is on)."""
    h = model.trunk.activations(input_ids, attn_mask=packed_attention_mask(segment_ids), pos_ids=position_ids)
    logits = model.head(h).astype(jnp.float32)["value", 0]
    total = hax.maximum(hax.sum(weights), 1e-9)
    # log σ(x) = -softplus(-x), log(1 − σ(x)) = -softplus(x): stable for any logit
    per_token = labels * hax.nn.softplus(-logits) + (1.0 - labels) * hax.nn.softplus(logits)
    bce = hax.sum(per_token * weights) / total
    w_last = hax.where(is_last, weights, 0.0)
    n_last = hax.maximum(hax.sum(w_last), 1e-9)
    correct = ((logits > 0) == (labels > 0.5)).astype(jnp.float32)
    metrics = {
        "loss": bce.array,
        "accuracy": (hax.sum(correct * w_last) / n_last).array,
        "mean_probability": (hax.sum(hax.nn.sigmoid(logits) * w_last) / n_last).array,
    }
    loss = bce.array
    if token_head is not None and token_weight > 0:
        Embed = model.head.In
        token_logits = hax.dot(h, token_head, axis=Embed).astype(jnp.float32)
        Vocab = next(ax for ax in token_head.axes if ax != Embed)
        log_z = hax.nn.logsumexp(token_logits, axis=Vocab)
        target = hax.take(token_logits, Vocab, token_targets)  # the target token's logit, over the rows' axes
        ce = hax.sum((log_z - target) * token_mask) / hax.maximum(hax.sum(token_mask), 1.0)
        loss = loss + token_weight * ce.array
        metrics["token_ce"] = ce.array
    return loss, metrics


# ---- checkpoints -------------------------------------------------------------------------------------------------
def _spec_json(spec: RewardModelSpec) -> dict[str, Any]:
    model = dataclasses.replace(spec.model, init_from_hf=None)  # the weights are in the checkpoint
    return {
        "format": FORMAT,
        "kind": "marin_rl.reward_model",
        "model": draccus.encode(model),
        "vocab_size": int(spec.vocab_size),
        "tokenizer": draccus.encode(spec.tokenizer),
        "output": spec.output,
        "info": spec.info,
    }


def save_reward_model(model: ValueModel, spec: RewardModelSpec, path: str) -> str:
    """Write `model` and `spec` as a checkpoint directory at `path` (local or fsspec URL; created if needed, an
    existing checkpoint there is replaced). The weights go first, `reward_model.json` last. Returns `path`."""
    embed_rows = int(model.trunk.Vocab.size) if hasattr(model.trunk, "Vocab") else spec.vocab_size
    if embed_rows != spec.vocab_size:
        raise ValueError(
            f"saving a reward model: its vocabulary has {embed_rows} rows, spec.vocab_size says {spec.vocab_size}"
        )
    fs, root = fsspec.core.url_to_fs(path)
    if fs.exists(os.path.join(root, SPEC_FILE)):
        fs.rm(os.path.join(root, SPEC_FILE))  # no longer a complete checkpoint while its weights are rewritten
    fs.makedirs(root, exist_ok=True)
    arrays = [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))]
    with fsspec.open(os.path.join(path, WEIGHTS_FILE), "wb") as f:
        eqx.tree_serialise_leaves(f, arrays)
    with fsspec.open(os.path.join(path, SPEC_FILE), "w") as f:
        json.dump(_spec_json(spec), f, indent=1)
    return path


def read_reward_model_spec(path: str) -> RewardModelSpec:
    """The spec of the checkpoint at `path`. Raises FileNotFoundError when `path` holds no complete reward-model
    checkpoint, ValueError when its `reward_model.json` cannot be read as one."""
    spec_path = os.path.join(path, SPEC_FILE)
    fs, plain = fsspec.core.url_to_fs(spec_path)
    if not fs.exists(plain):
        raise FileNotFoundError(
            f"{path} is not a reward-model checkpoint: it has no {SPEC_FILE} (missing, or a "
            "checkpoint whose writer did not finish)"
        )
    with fsspec.open(spec_path, "r") as f:
        raw = json.load(f)
    if raw.get("kind") != "marin_rl.reward_model" or int(raw.get("format", 0)) > FORMAT:
        raise ValueError(
            f"{spec_path}: not a reward-model spec this marin_rl reads (kind {raw.get('kind')!r}, "
            f"format {raw.get('format')!r}; this version reads format <= {FORMAT})"
        )
    try:
        return RewardModelSpec(
            model=draccus.decode(ModelConfig, raw["model"]),
            vocab_size=int(raw["vocab_size"]),
            tokenizer=draccus.decode(TokenizerConfig, raw["tokenizer"]),
            output=raw.get("output", "sigmoid"),
            info=dict(raw.get("info") or {}),
        )
    except (KeyError, TypeError, draccus.utils.DecodingError) as e:
        raise ValueError(f"{spec_path}: malformed reward-model spec: {e}") from e


def load_reward_model(path: str) -> tuple[ValueModel, RewardModelSpec]:
    """The reward model and spec of the checkpoint at `path` (float32 arrays on the default device). Raises
    FileNotFoundError for a missing or incomplete checkpoint and ValueError when the weights do not fit the spec."""
    spec = read_reward_model_spec(path)
    arch = resolved_architecture(spec.model)
    vocab = hax.Axis("vocab", spec.vocab_size)
    template = eqx.filter_eval_shape(lambda: value_model_from(arch.build(vocab, key=jax.random.PRNGKey(0))))
    params, static = eqx.partition(template, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    shapes, treedef = jax.tree_util.tree_flatten(params)
    weights = os.path.join(path, WEIGHTS_FILE)
    try:
        with fsspec.open(weights, "rb") as f:
            loaded = eqx.tree_deserialise_leaves(f, list(shapes))
    except FileNotFoundError as e:
        raise FileNotFoundError(f"reward-model checkpoint {path} has a spec but no {WEIGHTS_FILE}") from e
    except Exception as e:  # a different number of arrays ends the file early (or leaves bytes over)
        raise ValueError(f"{weights} does not hold the arrays of the architecture in {SPEC_FILE}: {e}") from e
    for i, (want, got) in enumerate(zip(shapes, loaded, strict=True)):
        if tuple(want.shape) != tuple(got.shape):
            raise ValueError(
                f"{weights}: array {i} has shape {tuple(got.shape)}, the architecture in {SPEC_FILE} "
                f"needs {tuple(want.shape)}"
            )
    arrays = [jnp.asarray(x, dtype=want.dtype) for want, x in zip(shapes, loaded, strict=True)]
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, arrays), static), spec


def with_extra_layers(model: LmHeadModel, config: ModelConfig, extra: int) -> tuple[LmHeadModel, ModelConfig]:
    """`model` with `extra` freshly initialised transformer layers on top of its own (seeded by `config.seed` + 1),
    and the config of the result. The new layers read what the model's last layer computed at every position (for a
    language model: its prediction of each next token), which a reward model can compare with the tokens that follow.
    Needs an architecture with `num_layers` whose layers are stacked (`scan_layers: true`)."""
    arch = config.architecture
    if extra < 1:
        return model, config
    n = getattr(arch, "num_layers", None)
    if n is None or not getattr(arch, "scan_layers", False):
        scan = getattr(arch, "scan_layers", None)
        raise ValueError(
            f"adding layers needs an architecture with num_layers and scan_layers: true; "
            f"{type(arch).__name__} has num_layers={n}, scan_layers={scan}"
        )
    bigger = dataclasses.replace(
        config, architecture=dataclasses.replace(arch, num_layers=n + extra), init_from_hf=None, seed=config.seed + 1
    )
    fresh = build_model(bigger, model.Vocab.size)
    old_arrays, _ = eqx.partition(model, eqx.is_array)
    new_arrays, static = eqx.partition(fresh, eqx.is_array)
    old_leaves = jax.tree_util.tree_leaves(old_arrays)
    new_leaves, treedef = jax.tree_util.tree_flatten(new_arrays)
    if len(old_leaves) != len(new_leaves):
        raise ValueError(
            f"adding layers: the {n + extra}-layer model has {len(new_leaves)} arrays, the {n}-layer one "
            f"{len(old_leaves)}"
        )
    merged = []
    for old, new in zip(old_leaves, new_leaves, strict=True):
        if old.shape == new.shape:
            merged.append(old)
        elif old.shape[0] == n and new.shape == (n + extra, *old.shape[1:]):
            merged.append(jnp.concatenate([old, new[n:].astype(old.dtype)], axis=0))
        else:
            raise ValueError(f"adding layers: cannot place an array of shape {old.shape} in one of {new.shape}")
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, merged), static), bigger
