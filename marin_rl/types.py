"""Core data types that flow through the RL loop.

Rollouts cross process boundaries (env actor -> replay buffer) and go to disk as plain JSON-compatible
dicts (`to_dict` / `from_dict`), never as pickles: `from_dict` validates what it reads and names what is
wrong. The packed training batch is a host-side `PackedBatch` of NumPy arrays; the learner puts it on its devices as
an `RlExample` (`marin_rl.learner.batch`). Its per-token fields are declared once, in `TOKEN_FIELDS`. Nothing here
imports JAX.

A rollout's tokens from the engine to the loss, one representation after the other (the forms that only carry
another across a boundary are marked "wire"; the Parquet rows of `marin_rl.replay.store` are a side branch to disk):

1. `marin_rl.inference.openai_api.Completion` — one sampled choice, as the engine's backend returns it.
   (wire: the OpenAI-compatible JSON choice over HTTP; absent with `InProcessPolicyClient`, which reads the
   `Completion` directly.)
2. `marin_rl.inference.client.Sample` — the client's token-exact sample, with the versions that sampled it.
3. `Turn` / `Rollout` / `RolloutGroup` (here) — the environment's episode and group; the same classes on the driver.
   (wire, Ray backend only: `marin_rl.rollouts.worker.GroupResult.to_dict()`, the group's `to_dict()` with its
   request counters, parsed and validated again by the replay buffer with `RolloutGroup.from_dict`.)
4. `marin_rl.replay.buffer.ReplayItem` — an accepted rollout (the `Rollout` itself, not a copy) with its advantage.
5. `marin_rl.replay.packing.Sequence` — the rollout's per-token training fields as NumPy arrays (`SEQUENCE_FIELDS`).
6. `PackedBatch` (here) — sequences packed into `(rows, max_seq_len)` arrays (`TOKEN_FIELDS`).
7. `marin_rl.learner.batch.RlExample` — the batch as named arrays on the devices, which the losses read.
   (wire, inside the jitted step: `marin_rl.learner.batch.chunked`'s raw arrays per microbatch, each turned back
   into an `RlExample` by `from_raw` for the loss.)

Seven typed representations (six that copy the tokens: a `ReplayItem` holds its `Rollout`); with the wire forms,
ten on the longest path (a Ray run with an HTTP server and microbatches), seven on a local run in one process
without microbatches.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any

import numpy as np

ROLES = ("system", "user", "assistant", "tool")
DROP_REASON = "drop_reason"
"""The `Rollout.metadata` key by which an environment marks a rollout not to train on (its tokens cannot be trusted,
e.g. a token capture whose turns do not extend each other): the value is a short reason code. The rollout still
counts in its group's advantages; the replay buffer drops it unused, counted under `replays/{env}/dropped/{reason}`."""


class RolloutFormatError(ValueError):
    """A rollout or group read from another process or from disk does not match the schema.

    `reason` is a short code for metrics (e.g. 'logprob_count', 'token_out_of_vocab'); the message has the details.
    """

    def __init__(self, message: str, reason: str = "malformed"):
        super().__init__(message)
        self.reason = reason


@dataclass
class InferenceMetadata:
    """How a policy turn was produced: by which server, with which sampling parameters and weights."""

    server: str
    """Address (or name) of the inference server that sampled the turn."""
    model: str = ""
    """Model name reported by the server."""
    temperature: float = 1.0
    """Sampling temperature; the learner scales logits by 1/temperature to match."""
    max_tokens: int = 0
    """Generation limit that was requested."""
    version_start: int = -1
    """Policy version (learner step) of the weights when generation of the turn started."""
    version_end: int = -1
    """Policy version of the weights when generation of the turn finished."""
    token_versions: list[int] | None = None
    """Policy version that sampled each token of the turn (a turn generated across weight updates has several);
    None: every token is attributed to `version_start`."""
    finish_reason: str = "stop"
    """'stop' (a stop token was sampled) or 'length' (hit `max_tokens`)."""
    latency_s: float = 0.0
    """Wall time of the request."""


@dataclass
class Turn:
    """One message of a conversation, with the exact token ids that the model saw or produced."""

    role: str
    """'system', 'user', 'assistant' or 'tool'."""
    message: str
    """Decoded text of the turn."""
    token_ids: list[int]
    """Token ids of the turn, exactly as sent to or sampled from the server."""
    sampler_logprobs: list[float] | None = None
    """Sampler's log-probability of each token; present exactly for policy-sampled turns."""
    reward: float = 0.0
    """Scalar reward of this turn (the weighted sum of `rewards` when those are given)."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Named reward components, e.g. {'correct': 1.0}."""
    inference_metadata: InferenceMetadata | None = None
    """Present for policy-sampled turns."""
    timestamp: float = field(default_factory=time.time)
    """Unix time the turn was created."""
    teacher_logprobs: list[float] | None = None
    """A teacher model's log-probability of each token of a sampled turn, given the conversation before it (on-policy
    distillation, `marin_rl.inference.teacher`); None when no teacher scored the turn."""
    teacher_top_ids: list[list[int]] | None = None
    """Top-k distillation (`teacher.top_k` > 0): per token of a sampled turn, the ids of the teacher's k most likely
    tokens at that position (given the conversation before it), most likely first; None otherwise."""
    teacher_top_logprobs: list[list[float]] | None = None
    """The teacher's logprobs of `teacher_top_ids`, per token of a sampled turn; None otherwise."""
    routed_experts: list[list[int]] | None = None
    """Routing replay, a mixture-of-experts policy: per token of the turn, the experts the sampler sent it to in each
    expert layer (layers × k indices, layer-major; -1 where none was recorded, e.g. a turn's last sampled token, which
    the sampler never fed to the model); None when not recorded (`marin_rl.model.moe`)."""

    @property
    def is_sampled(self) -> bool:
        """Whether the policy sampled this turn (and so it is trained on)."""
        return self.sampler_logprobs is not None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-compatible data: what `dataclasses.asdict` gives (lists, dicts and the metadata copied), without
        its deep recursion, which costs as much as the rest of persisting a rollout."""
        out = {name: _copied(getattr(self, name)) for name in _TURN_FIELDS}
        meta = self.inference_metadata
        out["inference_metadata"] = None if meta is None else {n: _copied(getattr(meta, n)) for n in _METADATA_FIELDS}
        return out

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Turn:
        """Inverse of `to_dict`; also reads dicts written before the field was named `sampler_logprobs` ('logprobs')."""
        meta = d.get("inference_metadata")
        d = {**d, "sampler_logprobs": d["sampler_logprobs"] if "sampler_logprobs" in d else d.get("logprobs")}
        return Turn(
            role=d["role"],
            message=d["message"],
            token_ids=[int(t) for t in d["token_ids"]],
            reward=float(d.get("reward", 0.0)),
            rewards={str(k): float(v) for k, v in (d.get("rewards") or {}).items()},
            inference_metadata=None if meta is None else InferenceMetadata(**meta),
            timestamp=float(d.get("timestamp", 0.0)),
            **{name: _token_list(d.get(name), dtype, top_k) for name, (dtype, top_k) in TURN_TOKEN_LISTS.items()},
        )


TURN_TOKEN_LISTS: dict[str, tuple[type, bool]] = {
    "sampler_logprobs": (np.float64, False),
    "teacher_logprobs": (np.float64, False),
    "teacher_top_ids": (np.int32, True),
    "teacher_top_logprobs": (np.float32, True),
    "routed_experts": (np.int16, True),
}
"""The optional per-token lists of a `Turn` (None when absent): element dtype (as stored, `marin_rl.replay.store`) and
whether each token has a list of k (the teacher's top-k). `Turn.from_dict` and the Parquet turn struct follow it."""


def _token_list(value: Any, dtype: type, top_k: bool) -> list | None:
    """A per-token list read back as plain Python numbers (lists of k of them with `top_k`), or None."""
    if value is None:
        return None
    cast = int if np.dtype(dtype).kind in "iu" else float
    return [[cast(x) for x in row] for row in value] if top_k else [cast(x) for x in value]


_TURN_FIELDS = tuple(f.name for f in fields(Turn))
_METADATA_FIELDS = tuple(f.name for f in fields(InferenceMetadata))


def _copied(value: Any) -> Any:
    """A list (of numbers, or of lists of numbers) or a dict of a turn, copied; anything else as it is."""
    if isinstance(value, list):
        return [list(x) if isinstance(x, list) else x for x in value]
    if isinstance(value, dict):
        return dict(value)
    return value


@dataclass
class Rollout:
    """One episode: the sequence of turns, ending with the policy's last turn or the environment's."""

    environment: str
    """Name of the environment that produced the rollout."""
    problem_id: str
    """Identifier of the problem within the environment."""
    turns: list[Turn]
    """Turns in order: prompt turns, sampled turns, tool/user turns, ..."""
    rollout_uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Globally unique id of this rollout."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form, JSON-compatible information (e.g. the parsed answer, 'truncated')."""

    # ---- token-level views used by the batcher -------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        """All token ids of the conversation, concatenated."""
        return [t for turn in self.turns for t in turn.token_ids]

    @property
    def num_tokens(self) -> int:
        return sum(len(turn.token_ids) for turn in self.turns)

    @property
    def num_sampled_tokens(self) -> int:
        return sum(len(turn.token_ids) for turn in self.turns if turn.is_sampled)

    def loss_mask(self) -> np.ndarray:
        """True exactly on tokens that the policy sampled."""
        return np.concatenate([np.full(len(t.token_ids), t.is_sampled, dtype=bool) for t in self.turns])

    def sampler_logprobs(self) -> np.ndarray:
        """Sampler logprob per token (0 on tokens that were not sampled)."""
        parts = [
            np.asarray(t.sampler_logprobs, dtype=np.float32) if t.is_sampled else np.zeros(len(t.token_ids), np.float32)
            for t in self.turns
        ]
        return np.concatenate(parts)

    @property
    def has_teacher_logprobs(self) -> bool:
        """Whether a teacher scored the sampled turns (`Turn.teacher_logprobs`)."""
        return any(t.teacher_logprobs is not None for t in self.turns)

    def teacher_logprobs(self) -> np.ndarray:
        """The teacher's logprob per token (0 on tokens that were not sampled)."""
        parts = [
            np.asarray(t.teacher_logprobs, dtype=np.float32)
            if t.is_sampled and t.teacher_logprobs is not None
            else np.zeros(len(t.token_ids), np.float32)
            for t in self.turns
        ]
        return np.concatenate(parts)

    @property
    def teacher_top_k(self) -> int:
        """k of the teacher's top-k logprobs on the sampled turns (`Turn.teacher_top_ids`), 0 when there are none."""
        for t in self.turns:
            if t.teacher_top_ids:
                return len(t.teacher_top_ids[0])
        return 0

    @property
    def routing_width(self) -> int:
        """Entries per token of the recorded routing (`Turn.routed_experts`: layers × k), 0 when none was recorded."""
        for t in self.turns:
            if t.routed_experts:
                return len(t.routed_experts[0])
        return 0

    def routed_experts(self) -> np.ndarray | None:
        """The recorded routing per token, `[num_tokens, layers × k]` int16 (-1 on tokens of turns that have none),
        or None when no turn has any."""
        width = self.routing_width
        if not width:
            return None
        parts = [
            np.full((len(t.token_ids), width), -1, np.int16)
            if t.routed_experts is None
            else np.asarray(t.routed_experts, dtype=np.int16).reshape(len(t.token_ids), width)
            for t in self.turns
        ]
        return np.concatenate(parts)

    def teacher_top(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The teacher's top-k token ids (int32) and logprobs (float32) per token, arrays `[num_tokens, k]` (0 on
        tokens that were not sampled)."""
        ids, lps = [], []
        for t in self.turns:
            n = len(t.token_ids)
            if t.is_sampled and t.teacher_top_ids is not None:
                ids.append(np.asarray(t.teacher_top_ids, dtype=np.int32).reshape(n, k))
                lps.append(np.asarray(t.teacher_top_logprobs, dtype=np.float32).reshape(n, k))
            else:
                ids.append(np.zeros((n, k), np.int32))
                lps.append(np.zeros((n, k), np.float32))
        return np.concatenate(ids), np.concatenate(lps)

    def token_versions(self) -> np.ndarray:
        """Policy version that sampled each token (-1 on tokens that were not sampled).

        Tokens of a turn generated across a weight update carry the version that sampled each of them when the
        server reported it (`InferenceMetadata.token_versions`), else the turn's oldest version (`version_start`),
        the conservative choice for staleness.
        """
        parts = []
        for t in self.turns:
            meta = t.inference_metadata if t.is_sampled else None
            if meta is not None and meta.token_versions is not None:
                parts.append(np.asarray(meta.token_versions, dtype=np.int32))
            else:
                parts.append(np.full(len(t.token_ids), -1 if meta is None else meta.version_start, dtype=np.int32))
        return np.concatenate(parts)

    @property
    def reward(self) -> float:
        """Total reward of the episode (sum over turns)."""
        return float(sum(t.reward for t in self.turns))

    @property
    def oldest_version(self) -> int:
        """Oldest policy version among the sampled turns (-1 if none was sampled)."""
        vs = [t.inference_metadata.version_start for t in self.turns if t.is_sampled and t.inference_metadata]
        return min(vs) if vs else -1

    @property
    def truncated(self) -> bool:
        """Whether the episode was cut off (length limit on a turn, or the env's turn/token limits)."""
        if self.metadata.get("truncated"):
            return True
        return any(
            t.inference_metadata is not None and t.inference_metadata.finish_reason == "length" for t in self.turns
        )

    # ---- serialization ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "environment": self.environment,
            "problem_id": self.problem_id,
            "rollout_uid": self.rollout_uid,
            "turns": [t.to_dict() for t in self.turns],
            "metadata": dict(self.metadata),
        }

    @staticmethod
    def from_dict(d: dict[str, Any], validate: bool = True) -> Rollout:
        """Inverse of `to_dict`; raises `RolloutFormatError` for a malformed dict, and (`validate`) for a rollout
        that fails `validate()` (without a vocabulary; callers that know one validate themselves)."""
        try:
            rollout = Rollout(
                environment=str(d["environment"]),
                problem_id=str(d["problem_id"]),
                rollout_uid=str(d["rollout_uid"]),
                turns=[Turn.from_dict(t) for t in d["turns"]],
                metadata=dict(d.get("metadata") or {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise RolloutFormatError(f"malformed rollout: {type(e).__name__}: {e}") from e
        if validate:
            rollout.validate()
        return rollout

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `RolloutFormatError` (with a `reason` code) naming the first inconsistency found.

        Checks: a non-empty prompt first and at least one sampled turn, known roles, integer token ids inside the
        vocabulary, exactly one finite logprob (<= 0) per sampled token, inference metadata with a policy version on
        sampled turns, finite rewards (named ones too); teacher logprobs, where a teacher scored the rollout, on every
        sampled turn and only there, one finite logprob (<= 0) per token; recorded routing, where a turn has it, one
        row of the rollout's width per token, indices >= -1.
        """
        uid = self.rollout_uid
        if not self.turns:
            raise RolloutFormatError(f"rollout {uid} has no turns")
        if self.turns[0].is_sampled:
            raise RolloutFormatError(f"rollout {uid}: the first turn must be a prompt, not a sampled turn")
        if not self.turns[0].token_ids:
            # position 0 of a row is predicted from nothing: a sampled token there would silently go untrained
            raise RolloutFormatError(f"rollout {uid}: empty prompt (the first turn has no tokens)", "empty_prompt")
        if not any(t.is_sampled for t in self.turns):
            raise RolloutFormatError(f"rollout {uid} has no policy-sampled turn", "no_sampled_tokens")
        for i, t in enumerate(self.turns):
            where = f"rollout {uid} turn {i}"
            if t.role not in ROLES:
                raise RolloutFormatError(f"{where}: unknown role {t.role!r}")
            ids = np.asarray(t.token_ids)
            if ids.size and ids.dtype.kind not in "iu":
                raise RolloutFormatError(f"{where}: token ids must be integers, got dtype {ids.dtype}")
            if ids.size and (ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size)):
                raise RolloutFormatError(
                    f"{where}: token ids span [{ids.min()}, {ids.max()}], outside a vocabulary of size {vocab_size}",
                    "token_out_of_vocab",
                )
            if not math.isfinite(t.reward) or any(not math.isfinite(v) for v in t.rewards.values()):
                raise RolloutFormatError(
                    f"{where}: non-finite reward {t.reward} (named rewards {t.rewards})", "nonfinite_reward"
                )
            if self.has_teacher_logprobs:
                if t.is_sampled != (t.teacher_logprobs is not None):
                    missing = "a sampled turn without" if t.is_sampled else "a turn that was not sampled with"
                    raise RolloutFormatError(f"{where}: {missing} teacher logprobs", "teacher_logprobs")
                if t.teacher_logprobs is not None:
                    tlp = np.asarray(t.teacher_logprobs, dtype=np.float64)
                    if tlp.size != len(t.token_ids):
                        raise RolloutFormatError(
                            f"{where}: {tlp.size} teacher logprobs for {len(t.token_ids)} sampled tokens",
                            "teacher_logprobs",
                        )
                    if tlp.size and not (np.isfinite(tlp).all() and tlp.max() <= 1e-6):
                        raise RolloutFormatError(
                            f"{where}: teacher logprobs must be finite and <= 0", "teacher_logprobs"
                        )
            if self.has_teacher_logprobs:
                _check_teacher_top(t, where, self.teacher_top_k, vocab_size)
            if t.routed_experts is not None:
                _check_routed_experts(t, where, self.routing_width)
            if t.is_sampled:
                if len(t.sampler_logprobs) != len(t.token_ids):
                    raise RolloutFormatError(
                        f"{where}: {len(t.sampler_logprobs)} logprobs for {len(t.token_ids)} sampled tokens",
                        "logprob_count",
                    )
                lp = np.asarray(t.sampler_logprobs, dtype=np.float64)
                if lp.size and not (np.isfinite(lp).all() and lp.max() <= 1e-6):
                    raise RolloutFormatError(f"{where}: logprobs must be finite and <= 0", "bad_logprob")
                if t.inference_metadata is None:
                    raise RolloutFormatError(f"{where}: sampled turn without inference metadata", "missing_metadata")
                meta = t.inference_metadata
                if meta.version_start < 0:
                    raise RolloutFormatError(
                        f"{where}: sampled turn without a policy version (version_start < 0)", "missing_metadata"
                    )
                if meta.token_versions is not None:
                    tv = np.asarray(meta.token_versions, dtype=np.int64)
                    if tv.size != len(t.token_ids):
                        raise RolloutFormatError(
                            f"{where}: {tv.size} token versions for {len(t.token_ids)} sampled tokens", "bad_versions"
                        )
                    if tv.size and (tv.min() < meta.version_start or tv.max() > meta.version_end):
                        raise RolloutFormatError(
                            f"{where}: token versions outside [version_start, version_end] = "
                            f"[{meta.version_start}, {meta.version_end}]",
                            "bad_versions",
                        )


def _check_routed_experts(t: Turn, where: str, width: int) -> None:
    """A turn's recorded routing: `[tokens, width]` integers (the rollout's one width), each an expert index or -1."""
    try:
        routes = np.asarray(t.routed_experts, dtype=np.int64).reshape(len(t.token_ids), width)
    except (ValueError, TypeError):
        raise RolloutFormatError(
            f"{where}: routed experts must be [{len(t.token_ids)} tokens, {width}] integers (one width a rollout)",
            "routed_experts",
        ) from None
    if routes.size and (routes.min() < -1 or routes.max() > np.iinfo(np.int16).max):
        raise RolloutFormatError(f"{where}: routed expert indices must lie in [-1, 32767]", "routed_experts")


def _check_teacher_top(t: Turn, where: str, k: int, vocab_size: int | None) -> None:
    """The teacher's top-k of a turn of a scored rollout: on every sampled turn and only there when the rollout has
    any (k > 0), `[tokens, k]` integer ids inside the vocabulary, distinct per token, and finite logprobs <= 0."""
    if k == 0:
        if t.teacher_top_ids is not None or t.teacher_top_logprobs is not None:
            raise RolloutFormatError(f"{where}: teacher top-k logprobs without their ids", "teacher_top_k")
        return
    if t.is_sampled != (t.teacher_top_ids is not None) or t.is_sampled != (t.teacher_top_logprobs is not None):
        missing = "a sampled turn without" if t.is_sampled else "a turn that was not sampled with"
        raise RolloutFormatError(f"{where}: {missing} the teacher's top-k", "teacher_top_k")
    if not t.is_sampled:
        return
    try:
        ids = np.asarray(t.teacher_top_ids, dtype=np.int64).reshape(len(t.token_ids), k)
        lps = np.asarray(t.teacher_top_logprobs, dtype=np.float64).reshape(len(t.token_ids), k)
    except ValueError:
        raise RolloutFormatError(
            f"{where}: the teacher's top-k must be [{len(t.token_ids)} tokens, k={k}] ids and logprobs",
            "teacher_top_k",
        ) from None
    if ids.size and (ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size)):
        raise RolloutFormatError(f"{where}: teacher top-k ids outside the vocabulary", "teacher_top_k")
    if ids.size and (np.diff(np.sort(ids, axis=1), axis=1) == 0).any():
        raise RolloutFormatError(f"{where}: repeated token ids in the teacher's top-k", "teacher_top_k")
    if lps.size and not (np.isfinite(lps).all() and lps.max() <= 1e-6):
        raise RolloutFormatError(f"{where}: teacher top-k logprobs must be finite and <= 0", "teacher_top_k")


@dataclass
class RolloutGroup:
    """Rollouts of one problem sampled together; advantages are computed within a group."""

    environment: str
    """Environment of every rollout in the group."""
    problem_id: str
    """Problem shared by every rollout in the group."""
    rollouts: list[Rollout]
    """The group's rollouts."""
    group_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Unique id of the group."""
    baseline_reward: float | None = None
    """ReMax's baseline: the reward of a greedy (temperature 0) episode of the same problem, sampled with the group
    and not trained on; None when the run's estimator needs none."""

    @property
    def rewards(self) -> np.ndarray:
        return np.asarray([r.reward for r in self.rollouts], dtype=np.float64)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "environment": self.environment,
            "problem_id": self.problem_id,
            "group_id": self.group_id,
            "rollouts": [r.to_dict() for r in self.rollouts],
        }
        if self.baseline_reward is not None:
            out["baseline_reward"] = self.baseline_reward
        return out

    @staticmethod
    def from_dict(d: dict[str, Any], validate: bool = True) -> RolloutGroup:
        """Inverse of `to_dict` (rollouts validated as `Rollout.from_dict` does, unless `validate` is false)."""
        try:
            group = RolloutGroup(
                environment=str(d["environment"]),
                problem_id=str(d["problem_id"]),
                group_id=str(d["group_id"]),
                rollouts=[Rollout.from_dict(r, validate) for r in d["rollouts"]],
                baseline_reward=None if d.get("baseline_reward") is None else float(d["baseline_reward"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise RolloutFormatError(f"malformed rollout group: {type(e).__name__}: {e}") from e
        for r in group.rollouts:
            if r.environment != group.environment or r.problem_id != group.problem_id:
                raise RolloutFormatError(
                    f"group {group.group_id} mixes ({r.environment}, {r.problem_id}) into "
                    f"({group.environment}, {group.problem_id})"
                )
        return group


@dataclass(frozen=True)
class TokenField:
    """One per-token field of a packed training batch: declared once here (`TOKEN_FIELDS`), iterated over by the
    packing (`marin_rl.replay.packing`) and the learner's batch (`marin_rl.learner.batch.RlExample.from_packed`)."""

    name: str
    """Attribute name on `PackedBatch` and `RlExample` (and on `marin_rl.replay.packing.Sequence`, unless `layout`)."""
    dtype: type
    """NumPy dtype of the packed array."""
    fill: Any
    """Value of padding, and of tokens that the field does not cover."""
    doc: str
    """What the field holds."""
    optional: bool = False
    """None when absent (a batch has it when its sequences do)."""
    top_k: bool = False
    """A trailing `[k]` axis (the teacher's top-k; routed experts' layers × k), named `trailing_axis` on the devices."""
    trailing_axis: str = "teacher_top_k"
    """With `top_k`: the name of the trailing axis in `marin_rl.learner.batch.RlExample`."""
    layout: bool = False
    """Derived by `pack` from where a sequence lands (ids, positions, segments; `truncated` from the sequence's
    `episode_truncated`), not carried per token by a `Sequence`."""


TOKEN_FIELDS: tuple[TokenField, ...] = (
    TokenField("input_ids", np.int32, 0, "Token ids (a `Sequence`'s `token_ids`).", layout=True),
    TokenField("position_ids", np.int32, 0, "Position of each token within its segment.", layout=True),
    TokenField("segment_ids", np.int32, -1, "Sequence number within the row; -1 on padding.", layout=True),
    TokenField("loss_mask", np.bool_, False, "True exactly on tokens that the policy sampled."),
    TokenField("advantages", np.float32, 0.0, "Advantage of each sampled token (0 elsewhere)."),
    TokenField(
        "sampler_logprobs",
        np.float32,
        0.0,
        "The sampler's log-probability of each token (0 where the policy did not sample).",
    ),
    TokenField(
        "token_versions", np.int32, -1, "Policy version that sampled each token; -1 where the policy did not sample."
    ),
    TokenField(
        "rewards",
        np.float32,
        0.0,
        "Reward credited to each sampled token (`marin_rl.replay.gae.token_rewards`); present when the replay buffers "
        "leave advantages to a critic (`replay.advantage_estimator: gae`), None otherwise.",
        optional=True,
    ),
    TokenField(
        "truncated",
        np.bool_,
        False,
        "With `rewards`: true on every token of an episode cut off by a length limit (its last step bootstraps from "
        "the critic's value instead of ending).",
        optional=True,
        layout=True,
    ),
    TokenField(
        "teacher_logprobs",
        np.float32,
        0.0,
        "A teacher's log-probability of each sampled token (0 elsewhere), when every packed rollout was scored by one "
        "(on-policy distillation); None otherwise.",
        optional=True,
    ),
    TokenField(
        "teacher_top_ids",
        np.int32,
        0,
        "Top-k distillation: `[..., k]` ids of the teacher's k most likely tokens at each sampled position (0 "
        "elsewhere); None when the teacher returned no top-k.",
        optional=True,
        top_k=True,
    ),
    TokenField(
        "teacher_top_logprobs",
        np.float32,
        0.0,
        "The teacher's logprobs of `teacher_top_ids` (`[..., k]`, 0 elsewhere), or None.",
        optional=True,
        top_k=True,
    ),
    TokenField(
        "routed_experts",
        np.int16,
        -1,
        "Routing replay: `[..., layers × k]` the experts the sampler sent each token to in each expert layer "
        "(layer-major; -1 where none was recorded: the learner's router chooses there), when the rollouts carry "
        "them (`Turn.routed_experts`); None otherwise.",
        optional=True,
        top_k=True,
        trailing_axis="routed_experts",
    ),
)
"""The per-token fields of a packed batch, in `PackedBatch`'s order. Adding one: declare it here (`PackedBatch` is made
from the declaration), add the attribute to `RlExample` (and to `Sequence` unless it is `layout`), produce it in
`Sequence.from_rollout`, consume it in a loss; copying, truncating, padding, packing and placing on the devices follow
from the declaration (a class whose attributes disagree with it fails at import, `check_token_fields`)."""

SEQUENCE_FIELDS: tuple[TokenField, ...] = tuple(f for f in TOKEN_FIELDS if not f.layout)
"""The fields a `marin_rl.replay.packing.Sequence` carries per token and `pack` copies into its rows as they are."""


def check_token_fields(cls: type, fields: tuple[TokenField, ...] = TOKEN_FIELDS) -> None:
    """Raise TypeError when `cls` (a dataclass or equinox module) lacks an attribute for a declared field, or has an
    optional one without a None default."""
    import dataclasses

    have = {f.name: f for f in dataclasses.fields(cls)}
    for f in fields:
        if f.name not in have:
            raise TypeError(f"{cls.__name__} has no attribute for the per-token field {f.name!r} (TOKEN_FIELDS)")
        if f.optional and have[f.name].default is not None:
            raise TypeError(f"{cls.__name__}.{f.name} is optional in TOKEN_FIELDS and needs a None default")


class _PackedBatchViews:
    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


PackedBatch = make_dataclass(
    "PackedBatch",
    [(f.name, np.ndarray | None, field(default=None)) if f.optional else (f.name, np.ndarray) for f in TOKEN_FIELDS],
    bases=(_PackedBatchViews,),
    namespace={
        "__doc__": """Host-side (NumPy) packed training batch; `marin_rl.learner.batch.RlExample.from_packed` puts it on
    devices. A dataclass with one attribute per field of `TOKEN_FIELDS` (in its order; an optional one defaults to
    None), and the views `num_rows` and `seq_len`.

    Every array has shape `(rows, max_seq_len)` (`(rows, max_seq_len, k)` for the teacher's top-k). Token t of a row
    is predicted from tokens `< t` of the same segment."""
    },
)
PackedBatch.__module__ = __name__  # pickles and prints as `marin_rl.types.PackedBatch`
