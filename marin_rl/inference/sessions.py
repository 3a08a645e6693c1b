"""Token capture: what each chat completion of a session sampled, token-exact, kept until the session is collected.

A client names its session with the `X-Session-Id` header, or in the body as `metadata: {"session_id": ...}` or
`user` (first found in that order). Every choice of a chat completion in a session is recorded as a
`CapturedCompletion`: the prompt ids the template rendered, the sampled ids (stop token included), their logprobs and
the policy version that sampled each, with the request's sampling. A `SessionStore` holds the records of each session
in the front end's process until `pop` hands them over and forgets them (`POST /v1/sessions/{id}/pop` over HTTP).

The store is bounded: at most `max_sessions` sessions (the least recently used is forgotten first), at most
`max_records` records per session (later ones are not kept and the session is marked `overflowed`), and a session
untouched for `ttl_s` seconds is forgotten. Each forgetting is counted (`evicted`, `expired`, `overflowed`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

SESSION_HEADER = "x-session-id"
"""The header that names a chat completion's session (HTTP headers are case-insensitive)."""


@dataclass
class CapturedCompletion:
    """One sampled choice of a chat completion, as the engine saw and produced it."""

    request_id: str
    """The response's id (`chatcmpl-...`); the choices of one request share it."""
    choice_index: int
    """The choice's index in the response."""
    num_choices: int
    """How many choices the request asked for (`n`)."""
    prompt_ids: list[int]
    """The prompt the engine sampled from (the rendered messages and generation prompt)."""
    token_ids: list[int]
    """The sampled ids (the stop token included when one was sampled)."""
    logprobs: list[float]
    """The sampler's logprob of each sampled id."""
    token_versions: list[int]
    """The policy version that sampled each id."""
    version_served: int
    """The version served when the request arrived (the choice's version when it sampled nothing)."""
    text: str
    """The sampled text as the engine decoded it (special tokens skipped)."""
    finish_reason: str
    """'stop', 'length' or 'tool_calls'."""
    temperature: float
    """The temperature it was sampled at."""
    max_tokens: int
    """The request's token limit."""
    last_role: str
    """The role of the request's last message (what the tokens before this turn's generation prompt answered)."""
    server: str
    """The server that sampled it."""
    latency_s: float
    """Seconds the backend took for the request."""
    sequence: int = 0
    """Arrival order within the session (set by the store)."""
    created: float = field(default_factory=time.time)
    """Unix time of the record."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> CapturedCompletion:
        """Inverse of `to_dict`."""
        return CapturedCompletion(**d)


@dataclass
class SessionRecords:
    """What `SessionStore.pop` returns: a session's records in arrival order, and whether some were not kept."""

    session_id: str
    records: list[CapturedCompletion]
    overflowed: bool = False
    """Records arrived beyond `max_records` and were not kept: the session is incomplete."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "records": [r.to_dict() for r in self.records],
            "overflowed": self.overflowed,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> SessionRecords:
        """Inverse of `to_dict`."""
        records = [CapturedCompletion.from_dict(r) for r in d["records"]]
        return SessionRecords(str(d["session_id"]), records, bool(d.get("overflowed", False)))


@dataclass
class _Session:
    records: list[CapturedCompletion] = field(default_factory=list)
    touched: float = field(default_factory=time.monotonic)
    overflowed: bool = False
    next_sequence: int = 0


class SessionStore:
    """Records of chat completions by session, bounded in sessions, records and age (module docstring).
    Thread-safe."""

    def __init__(self, max_sessions: int = 4096, max_records: int = 256, ttl_s: float = 3600.0):
        if max_sessions < 1 or max_records < 1 or not ttl_s > 0:
            raise ValueError(
                f"SessionStore needs max_sessions >= 1, max_records >= 1 and ttl_s > 0, got {max_sessions}, "
                f"{max_records} and {ttl_s}"
            )
        self.max_sessions, self.max_records, self.ttl_s = max_sessions, max_records, ttl_s
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently touched first
        self._lock = threading.Lock()
        self.recorded = 0
        """Records kept."""
        self.evicted = 0
        """Sessions forgotten because `max_sessions` were held."""
        self.expired = 0
        """Sessions forgotten after `ttl_s` untouched."""
        self.overflowed = 0
        """Records not kept because their session held `max_records`."""

    def _expire(self, now: float) -> None:
        while self._sessions:
            sid, session = next(iter(self._sessions.items()))
            if now - session.touched < self.ttl_s:
                break
            del self._sessions[sid]
            self.expired += 1

    def add(self, session_id: str, records: list[CapturedCompletion]) -> None:
        """Keep `records` (one request's choices) under `session_id`."""
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            session = self._sessions.pop(session_id, None)
            if session is None:
                session = _Session()
                while len(self._sessions) >= self.max_sessions:
                    self._sessions.popitem(last=False)
                    self.evicted += 1
            self._sessions[session_id] = session
            session.touched = now
            for r in records:
                if len(session.records) >= self.max_records:
                    session.overflowed = True
                    self.overflowed += 1
                    continue
                r.sequence = session.next_sequence
                session.next_sequence += 1
                session.records.append(r)
                self.recorded += 1

    def pop(self, session_id: str) -> SessionRecords:
        """The session's records, forgotten here (none for a session that recorded nothing or was forgotten)."""
        with self._lock:
            self._expire(time.monotonic())
            session = self._sessions.pop(session_id, None)
        if session is None:
            return SessionRecords(session_id, [])
        return SessionRecords(session_id, session.records, session.overflowed)

    def __len__(self) -> int:
        return len(self._sessions)

    def stats(self) -> dict[str, int]:
        """Sessions held and the counters."""
        return {
            "sessions": len(self),
            "recorded": self.recorded,
            "evicted": self.evicted,
            "expired": self.expired,
            "overflowed": self.overflowed,
        }


def session_id_of(headers, request) -> str | None:
    """The session a chat request belongs to: the `X-Session-Id` header, else `metadata.session_id`, else `user`;
    None when it names none."""
    sid = headers.get(SESSION_HEADER)
    if sid:
        return sid
    if request.metadata and request.metadata.get("session_id"):
        return request.metadata["session_id"]
    return request.user or None
