"""An episode's `Rollout` assembled from the token capture of its chat completions (`inference.sessions`).

The records of a session, in arrival order, are the policy turns of one conversation: each request's prompt must
extend the previous request's prompt and the choice it continued, token for token (the prefix property). Then

* the first request's prompt is the rollout's prompt turn;
* each request's sampled ids are a policy turn (loss mask on), with its logprobs and per-token versions as sampled;
* the ids between one turn's end and the next prompt's end — what the template inserts: the closing of the assistant
  message when the policy did not sample it, the tool results or user messages, the next generation prompt — are an
  environment turn (loss mask off).

A request with several choices (`n > 1`) is continued by the one choice the next prompt extends; the last request
must have one. When the prefix property fails (the template re-rendered an earlier turn's text into other ids, the
agent edited its history, or it ran two conversations in one session), the rollout is marked with
`metadata[DROP_REASON]` — `prefix_mismatch` (or `ambiguous_choice`, `capture_overflow`) — and holds the turns up to
the break: the replay buffer drops marked rollouts unused and counts them under `replays/{env}/dropped/{reason}`
(their rewards still count in their group's advantages). Nothing is re-tokenized here.
"""

from __future__ import annotations

from marin_rl.inference.sessions import CapturedCompletion, SessionRecords
from marin_rl.types import DROP_REASON, InferenceMetadata, Rollout, Turn

PREFIX_MISMATCH = "prefix_mismatch"
"""A request's prompt does not extend the previous prompt and sampled turn."""
AMBIGUOUS_CHOICE = "ambiguous_choice"
"""The last request sampled several choices: which one the episode kept is unknown."""
CAPTURE_OVERFLOW = "capture_overflow"
"""The server kept only the first records of the session (its store's `max_records`)."""


def _policy_turn(record: CapturedCompletion) -> Turn:
    versions = record.token_versions or []
    return Turn(
        role="assistant",
        message=record.text,
        token_ids=list(record.token_ids),
        sampler_logprobs=list(record.logprobs),
        inference_metadata=InferenceMetadata(
            server=record.server,
            temperature=record.temperature,
            max_tokens=record.max_tokens,
            version_start=int(versions[0]) if versions else record.version_served,
            version_end=int(versions[-1]) if versions else record.version_served,
            token_versions=list(versions),
            finish_reason=record.finish_reason,
            latency_s=record.latency_s,
        ),
        timestamp=record.created,
    )


def _requests(records: list[CapturedCompletion]) -> list[list[CapturedCompletion]]:
    """The records grouped by request, in arrival order."""
    out: list[list[CapturedCompletion]] = []
    for r in sorted(records, key=lambda r: r.sequence):
        if out and out[-1][0].request_id == r.request_id:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def assemble_rollout(session: SessionRecords, *, environment: str, problem_id: str, tokenizer=None) -> Rollout:
    """The rollout of one episode from its session's records (module docstring). `tokenizer` (optional) decodes the
    environment turns' text; without it their `message` is empty. Raises ValueError for a session with no record."""
    requests = _requests(session.records)
    if not requests:
        raise ValueError(f"session {session.session_id} has no chat completion: the agent never called the model")
    first = requests[0][0]
    turns = [Turn(role="user", message="", token_ids=list(first.prompt_ids))]
    if tokenizer is not None:
        turns[0].message = tokenizer.decode(first.prompt_ids, skip_special_tokens=False)
    context: list[int] = list(first.prompt_ids)
    reason: str | None = None
    detail: dict = {}
    for k, choices in enumerate(requests):
        prompt = choices[0].prompt_ids
        if k:
            if prompt[: len(context)] != context:
                at = _first_difference(prompt, context)
                reason = PREFIX_MISMATCH
                detail = {"request": k, "position": at, "expected_tokens": len(context), "prompt_tokens": len(prompt)}
                break
            inserted = prompt[len(context) :]
            if inserted:
                message = "" if tokenizer is None else tokenizer.decode(inserted, skip_special_tokens=False)
                role = "tool" if choices[0].last_role == "tool" else "user"
                turns.append(Turn(role=role, message=message, token_ids=list(inserted)))
                context = context + inserted
        if len(choices) == 1:
            chosen = choices[0]
        elif k + 1 < len(requests):
            following = requests[k + 1][0].prompt_ids
            fits = [c for c in choices if following[: len(context) + len(c.token_ids)] == context + c.token_ids]
            if not fits:
                reason, detail = PREFIX_MISMATCH, {"request": k + 1, "position": len(context), "choices": len(choices)}
                break
            chosen = fits[0]
        else:
            reason, detail = AMBIGUOUS_CHOICE, {"request": k, "choices": len(choices)}
            break
        turns.append(_policy_turn(chosen))
        context = context + list(chosen.token_ids)
    if reason is None and session.overflowed:
        reason, detail = CAPTURE_OVERFLOW, {"records": len(session.records)}
    metadata: dict = {"session_id": session.session_id, "requests": len(requests)}
    if reason is not None:
        metadata[DROP_REASON] = reason
        metadata["drop_detail"] = detail
    if not any(t.is_sampled for t in turns):  # the break came before any policy turn: keep the first one to show
        turns.append(_policy_turn(requests[0][0]))
    return Rollout(environment=environment, problem_id=problem_id, turns=turns, metadata=metadata)
