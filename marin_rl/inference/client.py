"""Policy client: samples completions from OpenAI-compatible servers with exact token ids and versions."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx
import numpy as np
from openai import APIConnectionError, APITimeoutError, AsyncOpenAI

logger = logging.getLogger("marin_rl")


@dataclass
class Sample:
    """One sampled completion, token-exact."""

    token_ids: list[int]
    """Sampled token ids (the stop token included when one was sampled)."""
    sampler_logprobs: list[float]
    """Sampler's log-probability of each sampled token."""
    text: str
    """Decoded completion text (special tokens skipped)."""
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


def versions_from_spans(spans: list[dict] | None, num_tokens: int) -> list[int] | None:
    """Per-token versions from `policy_version_spans` (None when absent); the spans must cover every token exactly.

    Any integer is a version, -1 included (a server that has never received weights)."""
    if spans is None:
        return None
    out: list[int | None] = [None] * num_tokens
    for span in spans:
        start, end = int(span["start"]), int(span["end"])
        if not 0 <= start <= end <= num_tokens:
            raise RuntimeError(f"policy_version_spans {spans} reach outside the {num_tokens} sampled tokens")
        out[start:end] = [int(span["version"])] * (end - start)
    if None in out:
        raise RuntimeError(f"policy_version_spans {spans} do not cover the {num_tokens} sampled tokens")
    return out  # type: ignore[return-value]


class PolicyClient:
    """Sends completion requests to one of several servers (least outstanding requests first).

    Prompts are sent as token ids and tokens come back as ids (`return_tokens_as_token_ids`, as in vLLM),
    so what the learner trains on is exactly what was sampled.
    """

    def __init__(
        self, servers: list[str], *, model: str = "policy", timeout_s: float = 600.0, max_concurrent_requests: int = 32
    ):
        if not servers:
            raise ValueError("PolicyClient needs at least one server address")
        self.servers = list(servers)
        self.model = model
        self._clients = {
            s: AsyncOpenAI(
                base_url=f"http://{s}/v1",
                api_key="unused",
                timeout=timeout_s,
                max_retries=2,
                http_client=httpx.AsyncClient(
                    timeout=timeout_s,
                    limits=httpx.Limits(
                        max_connections=max_concurrent_requests, max_keepalive_connections=max_concurrent_requests
                    ),
                ),
            )
            for s in self.servers
        }
        self._outstanding = dict.fromkeys(self.servers, 0)
        self._unreachable_until = dict.fromkeys(self.servers, 0.0)
        self.retried_requests = 0
        """Requests sent again to another server because theirs could not be reached."""
        self.requests = 0
        """Requests answered."""
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
        """Sample `n` completions of `prompt_ids` in one request to the least-loaded server. A server that cannot be
        reached (`openai.APIConnectionError`: gone, restarting) is avoided for `UNREACHABLE_S` and the request is sent
        to another one (counted in `retried_requests`); the error is raised once every server failed to connect."""
        tried: list[str] = []
        while True:
            server = self._pick_server(tried)
            self._outstanding[server] += n
            start = time.time()
            try:
                async with self._slots[server]:
                    queued = time.time() - start
                    resp = await self._create(
                        server, prompt_ids, n, max_tokens, temperature, stop, seed, stop_token_ids
                    )
            except APIConnectionError as e:
                if isinstance(e, APITimeoutError):  # reached but slow: sending it elsewhere would double the work
                    raise
                tried.append(server)
                self._unreachable_until[server] = time.time() + self.UNREACHABLE_S
                if len(tried) == len(self.servers):
                    raise
                self.retried_requests += 1
                logger.warning("server %s cannot be reached; sending the request to another server", server)
                continue
            finally:
                self._outstanding[server] -= n
            latency = time.time() - start
            self.requests += 1
            self.request_s += latency
            self.backend_s += float((resp.model_extra or {}).get("backend_s", 0.0))
            self.queue_s += queued
            return self._parse(resp, n, server, latency)

    async def _create(self, server, prompt_ids, n, max_tokens, temperature, stop, seed, stop_token_ids):
        return await self._clients[server].completions.create(
            model=self.model,
            prompt=list(prompt_ids),
            n=n,
            max_tokens=max_tokens,
            temperature=temperature,
            logprobs=0,
            stop=stop or None,
            seed=seed,
            extra_body={"return_tokens_as_token_ids": True, "stop_token_ids": list(stop_token_ids or [])},
        )

    @staticmethod
    def _parse(resp, n: int, server: str, latency: float) -> list[Sample]:
        if len(resp.choices) != n:
            raise RuntimeError(f"server {server} returned {len(resp.choices)} choices for n={n}")
        samples = []
        for choice in sorted(resp.choices, key=lambda c: c.index):
            if choice.logprobs is None or choice.logprobs.token_logprobs is None:
                raise RuntimeError(f"server {server} returned no logprobs; it must support `logprobs`")
            extra = choice.model_extra or {}
            samples.append(
                Sample(
                    token_ids=[_parse_token_id(t) for t in choice.logprobs.tokens],
                    sampler_logprobs=[float(x) for x in choice.logprobs.token_logprobs],
                    text=choice.text,
                    finish_reason=choice.finish_reason or "stop",
                    version_start=int(extra.get("policy_version_start", -1)),
                    version_end=int(extra.get("policy_version_end", -1)),
                    token_versions=versions_from_spans(extra.get("policy_version_spans"), len(choice.logprobs.tokens)),
                    server=server,
                    latency_s=latency,
                )
            )
        return samples

    async def aclose(self) -> None:
        for c in self._clients.values():
            await c.close()


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
