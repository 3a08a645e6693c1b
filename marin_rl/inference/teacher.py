"""Teacher scoring for on-policy distillation: a teacher model's logprob of every token the student sampled.

A teacher is any model a policy server serves (the embedded engine or vLLM, from a Hugging Face checkpoint, local or
on the hub). Nothing is generated: each rollout's whole token sequence goes to the teacher's server as one scoring
request (OpenAI's legacy prompt logprobs: `echo: true`, `max_tokens: 0`, `logprobs: 0`; `PolicyClient.score`), and
the logprob of each sampled token given everything before it is written to its turn's `teacher_logprobs`, which
travels with the rollout to the learner token-exactly, like the sampler's logprobs (the `teacher_inf` call of the
`opd` algorithm, `marin_rl.learner.algorithm`).

With `teacher.top_k` = k > 0 the request asks for `logprobs: k` too, and each sampled token also gets the teacher's k
most likely tokens at its position with their logprobs (`Turn.teacher_top_ids`, `teacher_top_logprobs`), for the
top-k forward-KL objective ('opd_forward_kl_topk', `marin_rl.learner.losses`).

The teacher scores at `teacher.temperature` (1: its own distribution; below 1 a sharper one, closer to its greedy
answers), whatever temperature the student sampled at.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from marin_rl.bounds import bounded, check_fields
from marin_rl.inference.client import PolicyClient
from marin_rl.inference.prompt_scores import MAX_SCORING_LOGPROBS, PromptScores
from marin_rl.types import Rollout, RolloutGroup


@dataclass
class TeacherConfig:
    """The teacher of on-policy distillation (`learner.algorithm: opd`): a model served by policy servers of the
    run's `inference.backend` (the embedded engine, or vLLM), with the policy's architecture (`model.architecture`),
    scoring the tokens the student samples."""

    path: str = ""
    """The teacher's weights: a Hugging Face checkpoint directory (local or gs://, with config.json), a run's output
    directory (its newest `hf/step-N` export), or a Hugging Face hub repository id (`org/model`, when no local
    directory of that name exists and `recipe` is not set)."""
    recipe: str | None = None
    """An experiment config (YAML) that makes the teacher: when `path` holds no checkpoint, the run first runs it
    as a step with its output_dir set to `path`, then distils from its export (None: a missing teacher is an
    error)."""
    temperature: float = bounded(1.0, gt=0)
    """Temperature of the teacher's distribution that the student is distilled toward: its logits / temperature (1:
    the teacher as it samples; below 1 sharper, toward its greedy answers, a stronger target than its own samples).
    The embedded server only: vLLM scores at 1."""
    num_servers: int = bounded(1, ge=1)
    """Servers serving the teacher (the env actors spread their scoring requests over them)."""
    request_timeout_s: float = bounded(600.0, gt=0)
    """Seconds a scoring request may take before it fails."""
    top_k: int = bounded(0, ge=0, le=MAX_SCORING_LOGPROBS)
    """Top-k distillation: the teacher also returns its k most likely tokens at every sampled position with their
    logprobs (a scoring request with `logprobs: k`, OpenAI's `top_logprobs`), carried to the learner for the
    objective 'opd_forward_kl_topk' (k ids and k logprobs per sampled token, 8k bytes in the batch). 0: off, the
    sampled tokens' logprobs only. At most 20 (vLLM's default bound)."""

    def __post_init__(self):
        check_fields(self, "teacher")


_STEP_DIR = re.compile(r"^step-(\d+)$")


def teacher_checkpoint(path: str, local: bool = False) -> str | None:
    """The Hugging Face checkpoint `path` names: itself when it holds config.json (or is a remote URL, or a hub id
    `org/model`, which the loader resolves), else the newest `hf/step-N` export of the run directory it is; None when
    it holds neither. `local`: `path` is a local directory (a recipe writes it), never a hub id."""
    if "://" in path:
        return path
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    hf_root = os.path.join(path, "hf")
    if os.path.isdir(hf_root):
        steps = [
            (int(m.group(1)), os.path.join(hf_root, name))
            for name in os.listdir(hf_root)
            if (m := _STEP_DIR.match(name)) and os.path.isfile(os.path.join(hf_root, name, "config.json"))
        ]
        if steps:
            return max(steps)[1]
    looks_like_hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~")) and not os.path.exists(path)
    return path if looks_like_hub_id and not local else None


def sequence_teacher_logprobs(rollout: Rollout, scored: list[float]) -> list[list[float] | None]:
    """Per turn, the teacher's logprobs of its tokens (None on turns the policy did not sample), from `scored`: the
    teacher's logprob of each token of `rollout.token_ids` after the first (ValueError for a length that does not
    match)."""
    if len(scored) != rollout.num_tokens - 1:
        raise ValueError(f"{len(scored)} teacher logprobs for a rollout of {rollout.num_tokens} tokens")
    per_token = [0.0, *scored]  # position 0 is predicted from nothing (a prompt token, never sampled)
    out: list[list[float] | None] = []
    start = 0
    for turn in rollout.turns:
        end = start + len(turn.token_ids)
        out.append(per_token[start:end] if turn.is_sampled else None)
        start = end
    return out


def sequence_teacher_top(rollout: Rollout, scored: PromptScores) -> list[tuple[list, list] | None]:
    """Per turn, the teacher's top-k ids and logprobs of its tokens' positions (`[tokens, k]` nested lists; None on
    turns the policy did not sample), from `scored` (the rollout's `PromptScores` with its top-k)."""
    n = rollout.num_tokens
    k = scored.top_ids.shape[1]
    if scored.top_ids.shape != (n - 1, k) or scored.top_logprobs.shape != (n - 1, k):
        raise ValueError(f"teacher top-k of shape {scored.top_ids.shape} for a rollout of {n} tokens")
    ids = np.concatenate([np.zeros((1, k), np.int32), scored.top_ids])  # position 0: never sampled
    lps = np.concatenate([np.zeros((1, k), np.float32), scored.top_logprobs])
    out: list[tuple[list, list] | None] = []
    start = 0
    for turn in rollout.turns:
        end = start + len(turn.token_ids)
        out.append((ids[start:end].tolist(), lps[start:end].tolist()) if turn.is_sampled else None)
        start = end
    return out


class TeacherScorer:
    """Scores rollouts with a teacher served at `servers` ('host:port' of policy servers serving the teacher), or
    through `client` (any client with `PolicyClient`'s `score_top_k` and `aclose`: the local backend's
    `InProcessPolicyClient` of an in-process teacher engine); with `top_k` > 0 the teacher's k most likely tokens at
    each sampled position too."""

    def __init__(
        self,
        servers: list[str] | None = None,
        *,
        client=None,
        timeout_s: float = 600.0,
        api_key: str | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
    ):
        if (servers is None) == (client is None):
            raise ValueError("TeacherScorer needs the teacher's servers or a client of it (one of the two)")
        self.client = client if client is not None else PolicyClient(servers, timeout_s=timeout_s, api_key=api_key)
        self.temperature = temperature
        self.top_k = top_k
        self.scored_tokens = 0
        """Tokens whose teacher logprob was written (sampled tokens of scored rollouts)."""

    async def score_group(self, group: RolloutGroup) -> RolloutGroup:
        """Write `teacher_logprobs` (and with `top_k` the teacher's top-k) on every sampled turn of the group's
        rollouts (one request for the group); returns the group."""
        rollouts = group.rollouts
        scored = await self.client.score_top_k([r.token_ids for r in rollouts], self.temperature, self.top_k)
        for rollout, scores in zip(rollouts, scored, strict=True):
            for turn, teacher in zip(rollout.turns, sequence_teacher_logprobs(rollout, scores.logprobs), strict=True):
                turn.teacher_logprobs = teacher
            if self.top_k:
                for turn, top in zip(rollout.turns, sequence_teacher_top(rollout, scores), strict=True):
                    turn.teacher_top_ids, turn.teacher_top_logprobs = (None, None) if top is None else top
            self.scored_tokens += rollout.num_sampled_tokens
        return group

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        await self.client.aclose()
