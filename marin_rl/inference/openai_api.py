"""The OpenAI completions dialect that every policy server speaks (the embedded engine and the vLLM front end).

It is OpenAI's `/v1/completions` with vLLM's extensions and a few of this project's:

* prompts may be token ids (`prompt: [1, 2, 3]`), so nothing is re-tokenized between sampling and training;
* `return_token_ids` (newer vLLM's) adds each choice's sampled ids as integers, `token_ids`;
  `return_tokens_as_token_ids` (vLLM's, older) spells each sampled token in `logprobs.tokens` as
  `token_id:N`, except with `return_token_ids`, where those strings would repeat `token_ids` (`tokens` is then
  null: the ids travel once, as integers; `PolicyClient` asks for both and reads whichever came);
* `stop_token_ids` adds stop tokens;
* every choice carries `policy_version_start`, `policy_version_end` and `policy_version_spans` (vLLM's weight-version
  spans: `[start, end)` token ranges sampled by one policy version);
* `GET /v1/version` is the version served now; `/health` answers 503 with the reason when the server has failed.

A backend (`CompletionBackend`) turns a validated request into `Completion`s; `openai_app` builds the FastAPI app
that serves it, with the request model, the choice and response builders and the error mapping (a bad request is
400, an unavailable backend 503) shared by every backend.

Routes that change what is served — `POST /v1/control/pause`, `/v1/control/resume` and `/v1/control/weights`
(apply the latest published weights) — require the run's secret as `Authorization: Bearer <secret>`: 401 without
it, 403 with another (or when the server has no secret), so that a server reachable from other nodes cannot be
steered by anyone who can reach it.
"""

from __future__ import annotations

import abc
import hmac
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi import Request as HttpRequest
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

SERVED_MODEL_NAME = "policy"
"""The model name servers report in `/v1/models` and responses."""


class CompletionRequest(BaseModel):
    """OpenAI completions request, plus vLLM's `stop_token_ids`, `return_token_ids` and `return_tokens_as_token_ids`."""

    model: str = SERVED_MODEL_NAME
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = 16
    temperature: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    seed: int | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    """Each choice carries its sampled ids as integers (`token_ids`); with `return_tokens_as_token_ids` too,
    `logprobs.tokens` is null rather than a `token_id:N` copy of them."""
    top_p: float | None = Field(default=None, description="Nucleus sampling (backends may support only 1.0).")

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list (one string, several, or none)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class BackendUnavailable(RuntimeError):
    """The backend cannot serve right now (e.g. restarting); the client may retry. Answered with HTTP 503."""


@dataclass
class Completion:
    """One sampled choice, as a backend returns it."""

    token_ids: list[int]
    """Sampled token ids (the stop token included when one was sampled)."""
    sampler_logprobs: list[float]
    """Sampler's log-probability of each sampled token."""
    text: str
    """Decoded text of the sampled tokens."""
    finish_reason: str
    """'stop' or 'length'."""
    token_versions: list[int]
    """Policy version that sampled each token (empty when no token was sampled)."""


def prompt_token_ids(prompt, tokenizer, max_seq_len: int) -> list[list[int]]:
    """The token ids of each prompt of a completions request (a string, token ids, or a list of either); raises
    ValueError for an empty prompt or one that leaves no room to generate within `max_seq_len`."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    out = []
    for p in prompt:
        ids = tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p)
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= max_seq_len:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds max_seq_len={max_seq_len}")
        out.append(ids)
    return out


def version_spans(token_versions: list[int]) -> list[dict[str, int]]:
    """Run-length form of per-token policy versions: `{"version", "start", "end"}` for the tokens `[start, end)`."""
    spans: list[dict[str, int]] = []
    for i, v in enumerate(token_versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": int(v), "start": i, "end": i + 1})
    return spans


def completion_choice(
    index: int, completion: Completion, request: CompletionRequest, tokenizer, served_version: int
) -> dict[str, Any]:
    """The OpenAI choice of one completion. A choice with no sampled token reports `served_version` (the version
    served when the request arrived) as its start and end.

    The sampled ids travel once: as integers in `token_ids` when the request asks for them (`return_token_ids`), else
    as `token_id:N` strings in `logprobs.tokens` (`return_tokens_as_token_ids`); plain OpenAI requests get the
    tokens' strings."""
    logprobs = None
    if request.logprobs is not None:
        if request.return_tokens_as_token_ids:
            token_strs = None if request.return_token_ids else [f"token_id:{t}" for t in completion.token_ids]
        else:
            token_strs = tokenizer.convert_ids_to_tokens(completion.token_ids)
        logprobs = {
            "tokens": token_strs,
            "token_logprobs": [float(x) for x in completion.sampler_logprobs],
            "text_offset": None,
            "top_logprobs": None,
        }
    versions = completion.token_versions
    choice = {
        "index": index,
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "logprobs": logprobs,
        "policy_version_start": int(versions[0]) if versions else int(served_version),
        "policy_version_end": int(versions[-1]) if versions else int(served_version),
        "policy_version_spans": version_spans(versions),
    }
    if request.return_token_ids:
        choice["token_ids"] = [int(t) for t in completion.token_ids]
    return choice


def completion_response(
    request: CompletionRequest,
    created: float,
    prompts: list[list[int]],
    choices: list[dict[str, Any]],
    completion_tokens: int,
    backend_s: float | None = None,
) -> dict[str, Any]:
    """The OpenAI `text_completion` body for `choices`, with token usage (each prompt counted `n` times) and, as an
    extra field, `backend_s`: the seconds the backend took (clients tell their HTTP overhead from it)."""
    prompt_tokens = sum(len(p) for p in prompts) * request.n
    extra = {} if backend_s is None else {"backend_s": backend_s}
    return {
        "id": f"cmpl-{uuid.uuid4().hex[:12]}",
        "object": "text_completion",
        "created": int(created),
        "model": request.model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        **extra,
    }


@dataclass
class FrontEndCounters:
    """What the front end counted: requests received and in progress, tokens sampled."""

    requests: int = 0
    outstanding: int = 0
    generated_tokens: int = 0
    rejected: int = 0
    """Requests answered 400 (bad request) or 503 (backend unavailable)."""
    started_at: float = field(default_factory=time.time)
    backend_s: float = 0.0
    """Seconds spent in the backend by the requests it answered (summed over requests)."""
    _busy_total: float = 0.0
    _busy_since: float = 0.0

    def request_started(self) -> None:
        """Count a request that arrived."""
        self.requests += 1
        if self.outstanding == 0:
            self._busy_since = time.perf_counter()
        self.outstanding += 1

    def request_ended(self) -> None:
        """Count the end of a request that `request_started` counted (answered or not)."""
        self.outstanding -= 1
        if self.outstanding == 0:
            self._busy_total += time.perf_counter() - self._busy_since

    @property
    def busy_s(self) -> float:
        """Seconds during which at least one request was in progress."""
        ongoing = time.perf_counter() - self._busy_since if self.outstanding > 0 else 0.0
        return self._busy_total + ongoing


class CompletionBackend(abc.ABC):
    """What a policy server implements for `openai_app`.

    `control_secret` (set by the server's owner) enables the control routes; `weights_source` (also set by the
    owner, e.g. `WeightSubscriber.poll`) applies the latest published weights and returns what it applied (None:
    nothing new).
    """

    name: str
    tokenizer: Any
    max_seq_len: int
    control_secret: str | None = None
    weights_source: Callable[[], dict | None] | None = None

    def pause(self) -> None:
        """Stop sampling after the engine work in progress; requests wait (generations in progress are frozen)."""
        raise NotImplementedError(f"{type(self).__name__} cannot pause")

    def resume(self) -> None:
        """Continue sampling after `pause`."""
        raise NotImplementedError(f"{type(self).__name__} cannot resume")

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Policy version of the weights served now (-1 before any weights were applied)."""

    @abc.abstractmethod
    async def complete(self, request: CompletionRequest, prompts: list[list[int]]) -> list[Completion]:
        """`request.n` completions of each prompt, prompt by prompt. Raises ValueError for a request the backend
        cannot serve (HTTP 400) and `BackendUnavailable` when it cannot serve now (HTTP 503)."""

    def failure(self) -> str | None:
        """Why the backend has failed for good (then `/health` answers 503), or None while it is healthy."""
        return None


def openai_app(backend: CompletionBackend, title: str, counters: FrontEndCounters | None = None) -> FastAPI:
    """The FastAPI app serving `backend` in this dialect (`/v1/completions`, `/v1/version`, `/v1/models`,
    `/health`); `counters` (created if not given) counts its requests."""
    app = FastAPI(title=title)
    counts = counters if counters is not None else FrontEndCounters()
    app.state.counters = counts

    @app.get("/health")
    async def health():
        failure = backend.failure()
        if failure is not None:
            return JSONResponse({"status": "failed", "error": failure}, status_code=503)
        return {"status": "healthy", "version": backend.version}

    @app.get("/v1/version")
    async def version():
        return {"version": backend.version}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": SERVED_MODEL_NAME, "object": "model", "owned_by": "marin_rl"}]}

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        counts.request_started()
        try:
            if request.max_tokens < 1:
                raise ValueError("max_tokens must be >= 1")
            if request.n < 1:
                raise ValueError("n must be >= 1")
            prompts = prompt_token_ids(request.prompt, backend.tokenizer, backend.max_seq_len)
            served = backend.version
            start = time.time()
            completions = await backend.complete(request, prompts)
            backend_s = time.time() - start
            counts.backend_s += backend_s
            choices = [completion_choice(i, c, request, backend.tokenizer, served) for i, c in enumerate(completions)]
            sampled = sum(len(c.token_ids) for c in completions)
            counts.generated_tokens += sampled
            # plain JSON types already: skip FastAPI's recursive jsonable_encoder (28% of the front end thread's busy
            # samples in a profile of the quickstart's requests)
            return JSONResponse(completion_response(request, start, prompts, choices, sampled, backend_s))
        except ValueError as e:
            counts.rejected += 1
            raise HTTPException(status_code=400, detail=str(e)) from e
        except BackendUnavailable as e:
            counts.rejected += 1
            raise HTTPException(status_code=503, detail=f"{backend.name}: {e}") from e
        finally:
            counts.request_ended()

    @app.post("/v1/control/{action}")
    async def control(action: str, request: HttpRequest):
        authorize(request.headers.get("authorization"), backend.control_secret)
        try:
            if action == "pause":
                await run_in_threadpool(backend.pause)
            elif action == "resume":
                await run_in_threadpool(backend.resume)
            elif action == "weights":
                if backend.weights_source is None:
                    raise NotImplementedError(f"{backend.name} has no weight source to poll")
                applied = await run_in_threadpool(backend.weights_source)
                return {"applied": applied, "version": backend.version}
            else:
                raise HTTPException(status_code=404, detail=f"no control action {action!r} (pause, resume, weights)")
        except NotImplementedError as e:
            raise HTTPException(status_code=501, detail=str(e)) from e
        return {"status": action, "version": backend.version}

    return app


def authorize(header: str | None, secret: str | None) -> None:
    """Raise HTTP 401 without an `Authorization: Bearer` header, 403 with a wrong secret or when none is set."""
    if not header or not header.lower().startswith("bearer "):
        raise HTTPException(status_code=401, detail="this route needs the run's secret: Authorization: Bearer <secret>")
    if secret is None:
        raise HTTPException(status_code=403, detail="control routes are disabled on this server (no secret is set)")
    if not hmac.compare_digest(header[len("bearer ") :].strip().encode(), secret.encode()):
        raise HTTPException(status_code=403, detail="wrong secret")
