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
* `echo: true` with `max_tokens: 0` scores the prompt instead of sampling (OpenAI's legacy prompt logprobs, served by
  vLLM too): each choice echoes its prompt's tokens, `logprobs.token_logprobs` holding the logprob of each given the
  ones before it (`null` for the first), from the backend's `score`;
* `POST /v1/chat/completions` is OpenAI's chat route over the same backend (`chat`: the chat template renders the
  messages and tools, tool calls are parsed from the output); a request that names a session has every choice's
  tokens recorded (`sessions`), and `POST /v1/sessions/{id}/pop` returns and forgets a session's records;
* a scoring request with `logprobs: k` > 0 (up to `MAX_SCORING_LOGPROBS`) also returns, at every position after the
  first, the k most likely tokens with their logprobs (`logprobs.top_logprobs`, keyed `token_id:N` with
  `return_tokens_as_token_ids`), from the backend's `score_top_k`;
* `GET /v1/version` is the version served now; `/health` answers 503 with the reason when the server has failed.

A backend (`CompletionBackend`) turns a validated request into `Completion`s; `openai_app` builds the FastAPI app
that serves it, with the choice and response builders and the error mapping shared by every backend. The request
and its checks are `completion_request`'s. Every error is in OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`: a request the client got wrong is a 400 naming the field (`param`), never a 500; an unavailable backend
is a 503; an unexpected failure is a 500 whose traceback the server logs.

With an API key (`inference.api_key`), `/v1/completions`, `/v1/chat/completions`, `/v1/sessions` and `/v1/models`
need `Authorization: Bearer <key>` (401 without it, as OpenAI answers); `/health` and `/v1/version` stay open
for monitors.

Routes that change what is served — `POST /v1/control/pause`, `/v1/control/resume` and `/v1/control/weights`
(apply the latest published weights) — require the run's secret as `Authorization: Bearer <secret>`: 401 without
it, 403 with another (or when the server has no secret), so that a server reachable from other nodes cannot be
steered by anyone who can reach it.
"""

from __future__ import annotations

import abc
import hmac
import ipaddress
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import FastAPI, HTTPException
from fastapi import Request as HttpRequest
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from marin_rl.inference.chat import (
    apply_sampling_headers,
    chat_message,
    chat_response,
    check_chat_request,
    end_of_turn_ids,
    logprobs_content,
    parse_chat_request,
)
from marin_rl.inference.completion_request import (
    SERVED_MODEL_NAME,
    CompletionRequest,
    InvalidRequest,
    RequestLimits,
    check_request,
    openai_answer,
    openai_error,
    parse_request,
)
from marin_rl.inference.prompt_scores import PromptScores, top_logprobs_entries
from marin_rl.inference.routing_payload import encode_routes
from marin_rl.inference.sessions import CapturedCompletion, SessionStore, session_id_of

logger = logging.getLogger(__name__)

__all__ = [
    "SERVED_MODEL_NAME",
    "BackendUnavailable",
    "Completion",
    "CompletionBackend",
    "CompletionRequest",
    "FrontEndCounters",
    "InvalidRequest",
    "RequestLimits",
    "openai_app",
]


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
    routed_experts: np.ndarray | None = None
    """A mixture-of-experts policy's routing of the prompt and the sampled tokens, when the request asked for it
    (`return_routed_experts`): [prompt + sampled tokens, layers × k] (`marin_rl.model.moe`), else None."""


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
    if request.return_routed_experts and completion.routed_experts is not None:
        choice["routed_experts"] = encode_routes(completion.routed_experts)
    return choice


def scoring_choice(
    index: int,
    prompt: list[int],
    logprobs: list[float],
    request: CompletionRequest,
    tokenizer,
    served_version: int,
    top: PromptScores | None = None,
) -> dict[str, Any]:
    """The OpenAI choice of a scored prompt (echo, nothing sampled): the prompt's text and tokens, and the logprob of
    each token given the ones before it (`None` for the first, as OpenAI and vLLM answer); with `top` (a request for
    `logprobs` > 0) the k most likely tokens at each position too, `top_logprobs` (`None` for the first)."""
    if len(logprobs) != len(prompt) - 1:
        raise RuntimeError(f"the backend scored {len(logprobs)} tokens of a {len(prompt)}-token prompt")
    if request.return_tokens_as_token_ids:
        token_strs = None if request.return_token_ids else [f"token_id:{t}" for t in prompt]
    else:
        token_strs = tokenizer.convert_ids_to_tokens(prompt)
    choice = {
        "index": index,
        "text": tokenizer.decode(prompt),
        "finish_reason": "length",
        "logprobs": {
            "tokens": token_strs,
            "token_logprobs": [None, *(float(x) for x in logprobs)],
            "text_offset": None,
            "top_logprobs": None if top is None else [None, *_top_entries(top, request, tokenizer)],
        },
        "policy_version_start": int(served_version),
        "policy_version_end": int(served_version),
        "policy_version_spans": [],
    }
    if request.return_token_ids:
        choice["token_ids"] = [int(t) for t in prompt]
    return choice


def _top_entries(top: PromptScores, request: CompletionRequest, tokenizer) -> list[dict[str, float]]:
    return top_logprobs_entries(top.top_ids, top.top_logprobs, bool(request.return_tokens_as_token_ids), tokenizer)


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
    completion_id = f"cmpl-{uuid.uuid4().hex[:12]}"
    body = openai_answer(
        "text_completion", completion_id, request.model, created, choices, prompt_tokens, completion_tokens
    )
    return {**body, **extra}


@dataclass
class FrontEndCounters:
    """What the front end counted: requests received and in progress, tokens sampled."""

    requests: int = 0
    outstanding: int = 0
    generated_tokens: int = 0
    rejected: int = 0
    """Requests answered 4xx (bad request, missing API key) or 503 (backend unavailable)."""
    failed: int = 0
    """Requests answered 500 (an unexpected failure of the server; each logged with its traceback)."""
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

    `limits` bound the requests it takes (`completion_request.check_request`); `api_key` (None: none) is what the
    OpenAI routes require; `control_secret` (set by the server's owner) enables the control routes; `weights_source`
    (also set by the owner, e.g. `WeightSubscriber.poll`) applies the latest published weights and returns what it
    applied (None: nothing new).
    """

    name: str
    tokenizer: Any
    max_seq_len: int
    limits: RequestLimits
    api_key: str | None = None
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
        """`request.n` completions of each prompt (`prompts`: the token ids `check_request` returned), prompt by
        prompt. Raises ValueError for a request the backend cannot serve (HTTP 400; `InvalidRequest` to name the
        field) and `BackendUnavailable` when it cannot serve now (HTTP 503)."""

    async def score(self, prompts: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Logprob of each token of each prompt after the first, given the tokens before it, at `temperature` (a
        scoring request: `echo` with `max_tokens: 0`; the distribution of logits / temperature). Raises
        `InvalidRequest` where the backend cannot score (or not at that temperature)."""
        raise InvalidRequest(f"{type(self).__name__} cannot score prompts (echo)", "echo")

    async def score_top_k(self, prompts: list[list[int]], temperature: float, k: int) -> list[PromptScores]:
        """`score`, and the k most likely tokens at every position after the first with their logprobs (a scoring
        request with `logprobs: k` > 0, OpenAI's `top_logprobs`). Raises `InvalidRequest` where the backend cannot."""
        raise InvalidRequest(f"{type(self).__name__} cannot score prompts with top logprobs", "logprobs")

    def failure(self) -> str | None:
        """Why the backend has failed for good (then `/health` answers 503), or None while it is healthy."""
        return None


def openai_app(
    backend: CompletionBackend,
    title: str,
    counters: FrontEndCounters | None = None,
    sessions: SessionStore | None = None,
) -> FastAPI:
    """The FastAPI app serving `backend` in this dialect (`/v1/completions`, `/v1/chat/completions`,
    `/v1/sessions/{id}/pop`, `/v1/version`, `/v1/models`, `/health`); `counters` (created if not given) counts its
    requests, `sessions` (created if not given; `app.state.sessions`) keeps the chat completions' token capture."""
    app = FastAPI(title=title)
    counts = counters if counters is not None else FrontEndCounters()
    app.state.counters = counts
    store = sessions if sessions is not None else SessionStore()
    app.state.sessions = store
    chat_stops: list[list[int]] = []  # the template's end-of-turn ids, computed at the first chat request

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind=kind, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def malformed(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        return error_response(400, f"{'.'.join(loc) or 'request'}: {first.get('msg', 'malformed request')}")

    @app.exception_handler(Exception)
    async def unexpected(request, exc: Exception):
        logger.error("%s: %s %s failed", backend.name, request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}", kind="server_error")

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
    async def models(http: HttpRequest):
        denied = check_api_key(http.headers.get("authorization"), backend.api_key)
        if denied is not None:
            return denied
        return {"object": "list", "data": [{"id": SERVED_MODEL_NAME, "object": "model", "owned_by": "marin_rl"}]}

    async def answered(http: HttpRequest, what: str, handle):
        """Count a request of the generation routes, check its API key, run `handle` and answer its failures in
        OpenAI's error shape: the client's (400/4xx), an unavailable backend (503), anything else (500, logged)."""
        counts.request_started()
        try:
            denied = check_api_key(http.headers.get("authorization"), backend.api_key)
            if denied is not None:
                counts.rejected += 1
                return denied
            return await handle()
        except InvalidRequest as e:
            counts.rejected += 1
            return error_response(e.status, e.message, param=e.param, code=e.code)
        except ValueError as e:
            counts.rejected += 1
            return error_response(400, str(e))
        except BackendUnavailable as e:
            counts.rejected += 1
            return error_response(503, f"{backend.name}: {e}", kind="server_error")
        except Exception as e:
            counts.failed += 1
            logger.error("%s: %s request failed", backend.name, what, exc_info=e)
            return error_response(500, f"{backend.name}: internal error: {type(e).__name__}: {e}", kind="server_error")
        finally:
            counts.request_ended()

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        async def handle():
            request = parse_request(await http.body())
            prompts = check_request(request, backend.tokenizer, backend.limits)
            served = backend.version
            start = time.time()
            if request.is_scoring:
                if request.logprobs:
                    tops = await backend.score_top_k(prompts, request.temperature, request.logprobs)
                    scored = [t.logprobs for t in tops]
                else:
                    scored = await backend.score(prompts, request.temperature)
                    tops = [None] * len(prompts)
                backend_s = time.time() - start
                counts.backend_s += backend_s
                choices = [
                    scoring_choice(i, p, lp, request, backend.tokenizer, served, top)
                    for i, (p, lp, top) in enumerate(zip(prompts, scored, tops, strict=True))
                ]
                return _json(completion_response(request, start, prompts, choices, 0, backend_s))
            completions = await backend.complete(request, prompts)
            backend_s = time.time() - start
            expected = request.n * len(prompts)
            if len(completions) != expected:
                raise RuntimeError(f"{backend.name} returned {len(completions)} completions, expected {expected}")
            counts.backend_s += backend_s
            choices = [completion_choice(i, c, request, backend.tokenizer, served) for i, c in enumerate(completions)]
            sampled = sum(len(c.token_ids) for c in completions)
            counts.generated_tokens += sampled
            return _json(completion_response(request, start, prompts, choices, sampled, backend_s))

        return await answered(http, "completion", handle)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        async def handle():
            request = apply_sampling_headers(parse_chat_request(await http.body()), http.headers)
            if not chat_stops:
                chat_stops.append(end_of_turn_ids(backend.tokenizer))
            completion_request, prompt = check_chat_request(request, backend.tokenizer, backend.limits, chat_stops[0])
            session = session_id_of(http.headers, request)
            served = backend.version
            start = time.time()
            completions = await backend.complete(completion_request, [prompt])
            backend_s = time.time() - start
            if len(completions) != request.n:
                raise RuntimeError(f"{backend.name} returned {len(completions)} completions, expected {request.n}")
            counts.backend_s += backend_s
            choices, records = [], []
            for i, c in enumerate(completions):
                message, calls_tools = chat_message(c.text, request.tools_enabled)
                finish = "tool_calls" if calls_tools else c.finish_reason
                versions = c.token_versions
                choice = {
                    "index": i,
                    "message": message,
                    "finish_reason": finish,
                    "logprobs": (
                        logprobs_content(backend.tokenizer, c.token_ids, c.sampler_logprobs)
                        if request.logprobs
                        else None
                    ),
                    "policy_version_start": int(versions[0]) if versions else int(served),
                    "policy_version_end": int(versions[-1]) if versions else int(served),
                    "policy_version_spans": version_spans(versions),
                }
                if request.return_token_ids:
                    choice["token_ids"] = [int(t) for t in c.token_ids]
                choices.append(choice)
                if session is not None:
                    records.append(
                        CapturedCompletion(
                            request_id="",
                            choice_index=i,
                            num_choices=request.n,
                            prompt_ids=list(prompt),
                            token_ids=[int(t) for t in c.token_ids],
                            logprobs=[float(x) for x in c.sampler_logprobs],
                            token_versions=[int(v) for v in versions],
                            version_served=int(served),
                            text=c.text,
                            finish_reason=finish,
                            temperature=float(completion_request.temperature),
                            max_tokens=int(completion_request.max_tokens),
                            last_role=request.messages[-1].role,
                            server=backend.name,
                            latency_s=backend_s,
                        )
                    )
            sampled = sum(len(c.token_ids) for c in completions)
            counts.generated_tokens += sampled
            body = chat_response(request, start, prompt, choices, sampled)
            if session is not None:
                for r in records:
                    r.request_id = body["id"]
                store.add(session, records)
            return _json(body)

        return await answered(http, "chat completion", handle)

    @app.post("/v1/sessions/{session_id}/pop")
    async def pop_session(session_id: str, http: HttpRequest):
        denied = check_api_key(http.headers.get("authorization"), backend.api_key)
        if denied is not None:
            return denied
        return _json(store.pop(session_id).to_dict())

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


def _json(body: dict) -> JSONResponse:
    """`body` as JSON. Plain JSON types already: FastAPI's recursive jsonable_encoder is skipped (28% of the front end
    thread's busy samples in a profile of the quickstart's requests). A non-finite number (JSON has none) is the
    server's fault, not the request's: RuntimeError, answered 500."""
    try:
        return JSONResponse(body)
    except ValueError as e:
        raise RuntimeError(f"the response cannot be encoded: {e}") from e


def error_response(
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict | None = None,
) -> JSONResponse:
    """A JSON response of OpenAI's error shape with HTTP `status`."""
    return JSONResponse(openai_error(message, kind=kind, param=param, code=code), status_code=status, headers=headers)


def check_api_key(header: str | None, api_key: str | None) -> JSONResponse | None:
    """None when `api_key` is None or `header` is `Bearer <api_key>`; else OpenAI's 401 answer."""
    if api_key is None:
        return None
    if not header or not header.lower().startswith("bearer "):
        return error_response(
            401,
            "You didn't provide an API key. You need to provide your API key in an Authorization header using "
            "Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not hmac.compare_digest(header[len("bearer ") :].strip().encode(), api_key.encode()):
        return error_response(401, "Incorrect API key provided.", code="invalid_api_key")
    return None


def warn_if_unprotected(name: str, bound_host: str, api_key: str | None) -> None:
    """Log a warning when a server binds beyond loopback without an API key (anyone who reaches it may sample)."""
    if api_key is not None:
        return
    try:
        loopback = ipaddress.ip_address(bound_host).is_loopback
    except ValueError:
        loopback = bound_host == "localhost"
    if not loopback:
        logger.warning(
            "%s listens on %s with no inference.api_key: anyone who can reach it can sample from the policy "
            "(control routes still need the run's secret)",
            name,
            bound_host,
        )


def authorize(header: str | None, secret: str | None) -> None:
    """Raise HTTP 401 without an `Authorization: Bearer` header, 403 with a wrong secret or when none is set."""
    if not header or not header.lower().startswith("bearer "):
        raise HTTPException(status_code=401, detail="this route needs the run's secret: Authorization: Bearer <secret>")
    if secret is None:
        raise HTTPException(status_code=403, detail="control routes are disabled on this server (no secret is set)")
    if not hmac.compare_digest(header[len("bearer ") :].strip().encode(), secret.encode()):
        raise HTTPException(status_code=403, detail="wrong secret")
