"""`InProcessPolicyClient`: a policy client that calls a server's backend in this process, without HTTP or JSON.

It answers exactly what `PolicyClient` answers for the same request (token ids, sampler logprobs, text, finish reason,
per-token versions), because it calls the same `CompletionBackend.complete` the HTTP front end calls, after the same
checks of the request (`completion_request.check_request`). It needs no API key: it is in the server's process. The
local backend's env workers sample through it from the colocated engine; environments cannot tell the two clients
apart.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from marin_rl.inference.client import Sample, ServerError
from marin_rl.inference.completion_request import CompletionRequest, InvalidRequest, check_request
from marin_rl.inference.openai_api import CompletionBackend
from marin_rl.inference.prompt_scores import PromptScores

T = TypeVar("T")


class InProcessPolicyClient:
    """`PolicyClient`'s `sample`, `score_top_k` and counters over a `CompletionBackend` of this process; call
    it from the event loop the backend answers in (the embedded server resolves its futures in the caller's loop). A
    request the checks or the backend refuse raises `ServerError` with the status, message and field the HTTP front
    end answers with."""

    def __init__(self, backend: CompletionBackend, routed_experts: bool = False):
        self.backend = backend
        self.routed_experts = routed_experts
        """Ask for each sample's routing (routing replay; see `PolicyClient.routed_experts`)."""
        self.servers = [f"in-process:{backend.name}"]
        self.retried_requests = 0
        """Always 0: nothing to reach."""
        self.requests = 0
        """`sample` calls answered."""
        self.request_s = 0.0
        """Seconds from each call to its answer, summed."""
        self.backend_s = 0.0
        """The same seconds (the backend is the whole request here)."""
        self.queue_s = 0.0
        """Always 0: no connection slots to wait for."""

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
        """`n` completions of `prompt_ids` from the backend (see `PolicyClient.sample`)."""

        async def complete():
            request = CompletionRequest(
                prompt=[int(t) for t in prompt_ids],
                max_tokens=int(max_tokens),
                temperature=float(temperature),
                n=int(n),
                stop=list(stop) if stop else None,
                stop_token_ids=[int(t) for t in stop_token_ids or []],
                logprobs=0,
                seed=None if seed is None else int(seed),
                return_token_ids=True,
                return_routed_experts=self.routed_experts,
            )
            prompts = check_request(request, self.backend.tokenizer, self.backend.limits)
            served = self.backend.version
            return served, await self.backend.complete(request, prompts)

        (served, completions), latency = await self._answer(complete)
        if self.routed_experts and any(c.routed_experts is None for c in completions):
            raise ServerError(
                self.servers[0],
                500,
                "no routed experts returned; routing replay (learner.moe.routing_replay) needs the dense engine "
                "serving a mixture-of-experts model",
            )
        return [
            Sample(
                token_ids=list(c.token_ids),
                sampler_logprobs=[float(x) for x in c.sampler_logprobs],
                text=c.text,
                finish_reason=c.finish_reason,
                version_start=int(c.token_versions[0]) if c.token_versions else served,
                version_end=int(c.token_versions[-1]) if c.token_versions else served,
                token_versions=[int(v) for v in c.token_versions],
                routed_experts=c.routed_experts,
                server=self.servers[0],
                latency_s=latency,
            )
            for c in completions
        ]

    async def score_top_k(self, prompts: list[list[int]], temperature: float, k: int) -> list[PromptScores]:
        """Each token sequence's logprobs, one per token after the first, and with `k` > 0 the k most likely tokens at
        every position after the first (see `PolicyClient.score_top_k`): the scoring request the HTTP front end serves
        (`echo`, `max_tokens: 0`, `logprobs: k`), checked as it checks one, answered by the same backend calls."""

        async def scores():
            request = CompletionRequest(
                prompt=[[int(t) for t in p] for p in prompts],
                max_tokens=0,
                echo=True,
                logprobs=int(k),
                temperature=float(temperature),
            )
            checked = check_request(request, self.backend.tokenizer, self.backend.limits)
            if k:
                return await self.backend.score_top_k(checked, request.temperature, request.logprobs)
            return [PromptScores(lp) for lp in await self.backend.score(checked, request.temperature)]

        scored, _ = await self._answer(scores)
        return scored

    async def _answer(self, call: Callable[[], Awaitable[T]]) -> tuple[T, float]:
        """`call()`'s result and its seconds, counted as one request; what the checks or the backend refuse is
        raised as the `ServerError` the HTTP front end would answer."""
        start = time.time()
        try:
            result = await call()
        except InvalidRequest as e:
            raise ServerError(self.servers[0], e.status, e.message, param=e.param) from e
        except ValueError as e:
            raise ServerError(self.servers[0], 400, str(e)) from e
        latency = time.time() - start
        self.requests += 1
        self.request_s += latency
        self.backend_s += latency
        return result, latency

    async def aclose(self) -> None:
        """Nothing to close (the backend belongs to its owner)."""
