"""Policy client: samples completions from OpenAI-compatible servers with exact token ids and versions."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx
import numpy as np

from marin_rl.inference.http_server import client_limits
from marin_rl.inference.prompt_scores import PromptScores, top_logprobs_arrays
from marin_rl.inference.routing_payload import decode_routes

logger = logging.getLogger("marin_rl")


@dataclass
class Sample:
    """One sampled completion, token-exact."""

    token_ids: list[int]
    """Sampled token ids (the stop token included when one was sampled)."""
    sampler_logprobs: list[float]
    """Sampler's log-probability of each sampled token."""
    text: str
    """Decoded completion text (special tokens skipped), as the server decoded it: environments use it rather than
    decoding `token_ids` again."""
    finish_reason: str
    """'stop' or 'length'."""
    version_start: int
    """Policy version of the weights when generation started."""
    version_end: int
    """Policy version of the weights when generation finished."""
    server: str
    """Address of the server that produced it."""
    latency_s: float
    """Wall time of the request."""
    token_versions: list[int] | None = None
    """Policy version that sampled each token (None when the server does not report `policy_version_spans`)."""
    routed_experts: np.ndarray | None = None
    """A mixture-of-experts policy's routing of the prompt and the sampled tokens ([prompt + sampled tokens, layers ×
    k], `marin_rl.model.moe`), when the client asked for it (`routed_experts=True`) and the server recorded it."""


def versions_from_spans(spans: list[dict] | None, num_tokens: int) -> list[int] | None:
    """Per-token versions from `policy_version_spans` (None when absent), built in one pass: the spans, in any
    order, must cover every token exactly once.

    Any integer is a version, -1 included (a server that has never received weights)."""
    if spans is None:
        return None
    out: list[int] = []
    for span in sorted(spans, key=lambda s: int(s["start"])):
        start, end = int(span["start"]), int(span["end"])
        if not 0 <= start <= end <= num_tokens:
            raise RuntimeError(f"policy_version_spans {spans} reach outside the {num_tokens} sampled tokens")
        if start != len(out):
            raise RuntimeError(f"policy_version_spans {spans} do not cover the {num_tokens} sampled tokens once")
        out += [int(span["version"])] * (end - start)
    if len(out) != num_tokens:
        raise RuntimeError(f"policy_version_spans {spans} do not cover the {num_tokens} sampled tokens")
    return out


def choice_token_ids(choice: dict) -> list[int] | None:
    """The sampled ids of one completions choice: its integer `token_ids` when the server answered them
    (`return_token_ids`: the embedded servers, newer vLLM), else parsed from its `logprobs.tokens` strings
    `token_id:N` (`return_tokens_as_token_ids`: older vLLM); None when it has neither."""
    ids = choice.get("token_ids")
    if ids is not None:
        return ids
    tokens = (choice.get("logprobs") or {}).get("tokens")
    return None if tokens is None else [_parse_token_id(t) for t in tokens]


class ServerUnreachable(ConnectionError):
    """No server could be reached (every one refused the connection or dropped it)."""


class ServerError(RuntimeError):
    """A server answered a completion request with an error: `status` is the HTTP status, `detail` its message
    (a 400 names what was wrong with the request, e.g. a prompt longer than the context) and `param` the request
    field it names (None: none)."""

    def __init__(self, server: str, status: int, detail: str, param: str | None = None):
        super().__init__(f"server {server} answered {status}: {detail}")
        self.server, self.status, self.detail, self.param = server, status, detail, param


def error_of(response: httpx.Response) -> tuple[str, str | None]:
    """(message, param) of an error answer: OpenAI's `{"error": {"message", "param"}}`, FastAPI's `{"detail"}`, or
    the body's text."""
    try:
        body = response.json()
    except ValueError:
        return response.text, None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", response.text)), error.get("param")
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"]), None
    return response.text, None


@dataclass(eq=False)
class _Call:
    """One `sample` call waiting to be sent, possibly together with others of the same parameters."""

    prompt_ids: list[int]
    n: int
    future: asyncio.Future


class PolicyClient:
    """Sends completion requests to one of several servers (least outstanding requests first).

    Prompts are sent as token ids and tokens come back as ids (integers with `return_token_ids`; `token_id:N`
    strings with `return_tokens_as_token_ids` from servers that do not know it, as older vLLM), so what the learner
    trains on is exactly what was sampled. A sample's text and per-token versions are the server's (its `text`, its
    `policy_version_spans`).

    Unseeded `sample` calls made in the same turn of the event loop with the same sampling parameters travel as one
    request with a list of prompts (the completions API's batch form), up to `max_prompts_per_request` of them: an
    env actor that starts many groups at once then costs the server and itself one request instead of dozens. Each
    call still gets exactly its own samples; a request refused as a whole (400) is split and its calls sent one by
    one, so only a bad call fails. Seeded calls always travel alone (a server derives choice k's seed from the
    request's seed). `max_prompts_per_request=1` sends every call alone.
    """

    RETRIES = 2
    """Resends of a request a server answered with 5xx (after 0.5 s, then 1 s), as OpenAI's client does."""

    def __init__(
        self,
        servers: list[str],
        *,
        model: str = "policy",
        timeout_s: float = 600.0,
        max_concurrent_requests: int = 32,
        max_prompts_per_request: int = 64,
        api_key: str | None = None,
        routed_experts: bool = False,
    ):
        if not servers:
            raise ValueError("PolicyClient needs at least one server address")
        if max_prompts_per_request < 1:
            raise ValueError(f"max_prompts_per_request must be >= 1, got {max_prompts_per_request}")
        self.servers = list(servers)
        self.model = model
        self.api_key = api_key
        """What the servers' `inference.api_key` asks for (None: nothing); chat agents reuse it."""
        self.max_prompts_per_request = max_prompts_per_request
        self.routed_experts = routed_experts
        """Ask for each sample's routing (`return_routed_experts`; routing replay): a server that does not return it
        fails the request."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else None
        self._http = {
            s: httpx.AsyncClient(
                base_url=f"http://{s}/v1",
                headers=headers,
                timeout=timeout_s,
                limits=client_limits(max_concurrent_requests, max_concurrent_requests),
            )
            for s in self.servers
        }
        self._outstanding = dict.fromkeys(self.servers, 0)
        self._unreachable_until = dict.fromkeys(self.servers, 0.0)
        self._pending: dict[tuple, list[_Call]] = {}  # sampling parameters -> calls waiting for this loop turn
        self.retried_requests = 0
        """Requests sent again to another server because theirs could not be reached."""
        self.requests = 0
        """Requests answered (one request may carry several calls' prompts)."""
        self.request_s = 0.0
        """Seconds from sending a request to its answer, summed over answered requests (waiting for a connection slot
        in this client included)."""
        self.backend_s = 0.0
        """Of those, the seconds the servers' backends report having taken (`backend_s` in the answer; servers that do
        not report it add nothing)."""
        self.queue_s = 0.0
        """Of those, the seconds spent waiting in this client for one of the server's `max_concurrent_requests`
        connection slots (requests beyond them queue here, not in the server)."""
        # httpx's connection pool does work quadratic in the number of waiting requests; queue them here instead.
        self._slots = {s: asyncio.Semaphore(max_concurrent_requests) for s in self.servers}

    UNREACHABLE_S = 30.0
    """How long a server that refused a connection gets no new requests while others are there."""

    def pick_server(self) -> str:
        """The server a new conversation should go to (the one `sample` would send a request to now), e.g. an
        agent's chat session, which stays on one server so that its token capture is in one place."""
        return self._pick_server([])

    def _pick_server(self, exclude: list[str]) -> str:
        """The reachable server with the fewest outstanding requests (those that just failed to connect last)."""
        now = time.time()
        candidates = [s for s in self.servers if s not in exclude]
        return min(candidates, key=lambda s: (self._unreachable_until[s] > now, self._outstanding[s]))

    async def sample(
        self,
        prompt_ids: list[int],
        *,
        n: int = 1,
        max_tokens: int,
        temperature: float = 1.0,
        stop_token_ids: list[int] | None = None,
        stop: list[str] | None = None,
        seed: int | None = None,
    ) -> list[Sample]:
        """Sample `n` completions of `prompt_ids` from the least-loaded server. A server that cannot be reached (gone,
        restarting) is avoided for `UNREACHABLE_S` and the request is sent to another one (counted in
        `retried_requests`); `ServerUnreachable` is raised once every server failed. A request answered with an
        error raises `ServerError` (after `RETRIES` resends for a 5xx); one that times out raises
        `httpx.TimeoutException` (the server was reached: sending it elsewhere would double the work)."""
        params = {
            "max_tokens": int(max_tokens),
            "temperature": float(temperature),
            "stop": list(stop) if stop else None,
            "stop_token_ids": [int(t) for t in stop_token_ids or []],
            "n": int(n),
        }
        if seed is not None or self.max_prompts_per_request == 1:
            return (await self._request([list(prompt_ids)], {**params, "seed": seed}))[0]
        key = (params["max_tokens"], params["temperature"], tuple(stop or ()), tuple(params["stop_token_ids"]), n)
        call = _Call(list(prompt_ids), n, asyncio.get_running_loop().create_future())
        calls = self._pending.setdefault(key, [])
        if not calls:  # the first call of this turn: send everything gathered once the turn ends
            asyncio.get_running_loop().call_soon(self._send_pending, key, params)
        calls.append(call)
        if len(calls) >= self.max_prompts_per_request:
            self._send_now(self._pending.pop(key), params)
        return await call.future

    def _send_pending(self, key: tuple, params: dict) -> None:
        calls = self._pending.pop(key, None)
        if calls:
            self._send_now(calls, params)

    def _send_now(self, calls: list[_Call], params: dict) -> None:
        task = asyncio.get_running_loop().create_task(self._answer(calls, params))
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)  # errors go to the futures

    async def _answer(self, calls: list[_Call], params: dict) -> None:
        """Send `calls` as one request and hand each its samples; a request refused as a whole is split."""
        try:
            results = await self._request([c.prompt_ids for c in calls], params)
        except ServerError as e:
            if len(calls) > 1 and e.status == 400 and e.param in ("prompt", None):
                # some prompt was bad: find out which, fail only that one
                await asyncio.gather(*(self._answer([c], params) for c in calls))
                return
            for c in calls:
                if not c.future.done():
                    c.future.set_exception(e)
            return
        except asyncio.CancelledError:
            for c in calls:
                c.future.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - handed to every waiting call
            for c in calls:
                if not c.future.done():
                    c.future.set_exception(e)
            return
        for c, samples in zip(calls, results, strict=True):
            if not c.future.done():
                c.future.set_result(samples)

    async def _request(self, prompts: list[list[int]], params: dict) -> list[list[Sample]]:
        """One completions request for `prompts` (each sampled `n` times), to the least-loaded reachable server;
        returns each prompt's samples."""
        n = params["n"]
        body = {
            "model": self.model,
            "prompt": prompts[0] if len(prompts) == 1 else prompts,
            "logprobs": 0,
            "return_token_ids": True,  # integer ids; then no `token_id:N` strings from the embedded servers
            "return_tokens_as_token_ids": True,  # for servers without `return_token_ids`
            **({"return_routed_experts": True} if self.routed_experts else {}),
            **{k: v for k, v in params.items() if v is not None},
        }
        tried: list[str] = []
        while True:
            server = self._pick_server(tried)
            self._outstanding[server] += n * len(prompts)
            start = time.time()
            try:
                async with self._slots[server]:
                    queued = time.time() - start
                    answer = await self._post(server, body)
            except httpx.TimeoutException:
                raise  # reached but slow: sending it elsewhere would double the work
            except (httpx.TransportError, ServerUnreachable) as e:
                tried.append(server)
                self._unreachable_until[server] = time.time() + self.UNREACHABLE_S
                if len(tried) == len(self.servers):
                    raise ServerUnreachable(f"no server could be reached ({', '.join(tried)}): {e!r}") from e
                self.retried_requests += 1
                logger.warning("server %s cannot be reached; sending the request to another server", server)
                continue
            finally:
                self._outstanding[server] -= n * len(prompts)
            latency = time.time() - start
            self.requests += 1
            self.request_s += latency
            self.backend_s += float(answer.get("backend_s", 0.0))
            self.queue_s += queued
            lengths = [len(p) for p in prompts] if self.routed_experts else None
            return self._parse(answer, len(prompts), n, server, latency, lengths)

    async def score(self, prompts: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Each token sequence's logprobs under the served model, one per token after the first (given the tokens
        before it, at `temperature`): one scoring request (OpenAI's `echo: true`, `max_tokens: 0`, `logprobs: 0`)
        to the least-loaded reachable server, sent to another when one cannot be reached."""
        return [s.logprobs for s in await self.score_top_k(prompts, temperature, 0)]

    async def score_top_k(self, prompts: list[list[int]], temperature: float, k: int) -> list[PromptScores]:
        """`score`, and with `k` > 0 the served model's k most likely tokens at every position after the first
        (`logprobs: k`, OpenAI's `top_logprobs` keyed `token_id:N`): `[len - 1, k]` integer ids and logprobs, most
        likely first."""
        body = {"model": self.model, "prompt": prompts, "echo": True, "max_tokens": 0, "logprobs": int(k)}
        if k:
            body["return_tokens_as_token_ids"] = True
        if temperature != 1.0:
            body["temperature"] = float(temperature)
        tried: list[str] = []
        while True:
            server = self._pick_server(tried)
            self._outstanding[server] += len(prompts)
            start = time.time()
            try:
                async with self._slots[server]:
                    answer = await self._post(server, body)
            except (httpx.TransportError, ServerUnreachable) as e:
                if isinstance(e, httpx.TimeoutException):
                    raise
                tried.append(server)
                self._unreachable_until[server] = time.time() + self.UNREACHABLE_S
                if len(tried) == len(self.servers):
                    raise ServerUnreachable(f"no server could be reached ({', '.join(tried)}): {e!r}") from e
                self.retried_requests += 1
                continue
            finally:
                self._outstanding[server] -= len(prompts)
            self.requests += 1
            self.request_s += time.time() - start
            self.backend_s += float(answer.get("backend_s", 0.0))
            choices = sorted(answer.get("choices") or [], key=lambda c: c["index"])
            if len(choices) != len(prompts):
                raise RuntimeError(f"server {server} scored {len(choices)} of {len(prompts)} sequences")
            out = []
            for choice, prompt in zip(choices, prompts, strict=True):
                logprobs = choice.get("logprobs") or {}
                lps = logprobs.get("token_logprobs") or []
                if len(lps) != len(prompt) or any(x is None for x in lps[1:]):
                    raise RuntimeError(f"server {server} returned {len(lps)} logprobs for {len(prompt)} tokens")
                scores = PromptScores([float(x) for x in lps[1:]])
                if k:
                    entries = logprobs.get("top_logprobs") or []
                    if len(entries) != len(prompt):
                        raise RuntimeError(
                            f"server {server} returned top logprobs for {len(entries)} of {len(prompt)} tokens"
                        )
                    scores.top_ids, scores.top_logprobs = top_logprobs_arrays(entries[1:], k, f"server {server}")
                out.append(scores)
            return out

    async def _post(self, server: str, body: dict) -> dict:
        """POST `body` to `server`'s completions route; 5xx answers are resent `RETRIES` times."""
        for attempt in range(self.RETRIES + 1):
            response = await self._http[server].post("/completions", json=body)
            if response.status_code < 500 or attempt == self.RETRIES:
                break
            await asyncio.sleep(0.5 * 2**attempt)
        if response.status_code != 200:
            raise ServerError(server, response.status_code, *error_of(response))
        return response.json()

    @staticmethod
    def _parse(
        answer: dict, num_prompts: int, n: int, server: str, latency: float, prompt_lengths: list[int] | None = None
    ) -> list[list[Sample]]:
        """Each prompt's samples from a completions answer; with `prompt_lengths` (the prompts' token counts), each
        choice must carry its routing (`routed_experts`)."""
        choices = sorted(answer.get("choices") or [], key=lambda c: c["index"])
        if len(choices) != num_prompts * n:
            raise RuntimeError(f"server {server} returned {len(choices)} choices for {num_prompts} prompts × n={n}")
        samples = []
        for index, choice in enumerate(choices):
            token_logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            if token_logprobs is None:
                raise RuntimeError(f"server {server} returned no logprobs; it must support `logprobs`")
            token_ids = choice_token_ids(choice)
            if token_ids is None:
                raise RuntimeError(
                    f"server {server} returned no token ids; it must support `return_token_ids` or "
                    "`return_tokens_as_token_ids`"
                )
            if len(token_ids) != len(token_logprobs):
                raise RuntimeError(
                    f"server {server} returned {len(token_ids)} token ids and {len(token_logprobs)} logprobs"
                )
            routes = None
            if prompt_lengths is not None:
                if choice.get("routed_experts") is None:
                    raise RuntimeError(
                        f"server {server} returned no routed_experts; routing replay (learner.moe.routing_replay) "
                        "needs the embedded server's dense engine serving a mixture-of-experts model"
                    )
                tokens = prompt_lengths[index // n] + len(token_ids)
                try:
                    routes = decode_routes(choice["routed_experts"], tokens)
                except ValueError as e:
                    raise RuntimeError(f"server {server}: {e}") from e
            samples.append(
                Sample(
                    token_ids=token_ids,
                    sampler_logprobs=[float(x) for x in token_logprobs],
                    routed_experts=routes,
                    text=choice.get("text", ""),
                    finish_reason=choice.get("finish_reason") or "stop",
                    version_start=int(choice.get("policy_version_start", -1)),
                    version_end=int(choice.get("policy_version_end", -1)),
                    token_versions=versions_from_spans(choice.get("policy_version_spans"), len(token_ids)),
                    server=server,
                    latency_s=latency,
                )
            )
        return [samples[i * n : (i + 1) * n] for i in range(num_prompts)]

    async def aclose(self) -> None:
        for c in self._http.values():
            await c.aclose()


def _parse_token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise ValueError(f"server returned token {token!r} instead of 'token_id:N'; it must honour token ids")
    return int(token.split(":", 1)[1])


class SeededPolicy:
    """A policy client whose `sample` calls carry seeds: the group's `seed` for the first call, then seeds derived
    from (seed, call number). A server samples choice k of a call with seed + k (the embedded server and vLLM both
    honour per-request seeds), so a group's samples are a function of its seed and the weights. Calls are numbered
    in the order they are made, which is deterministic for single-turn environments (one call per group)."""

    def __init__(self, client: PolicyClient, seed: int):
        self._client = client
        self._seed = int(seed)
        self._calls = 0

    async def sample(self, prompt_ids: list[int], **kwargs) -> list[Sample]:
        """`PolicyClient.sample` with the next seed (an explicit `seed` argument wins)."""
        if kwargs.get("seed") is None:
            seed = self._seed
            if self._calls:
                seed = int(np.random.SeedSequence([self._seed, self._calls]).generate_state(1)[0]) >> 2
            kwargs["seed"] = seed
        self._calls += 1
        return await self._client.sample(prompt_ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)
