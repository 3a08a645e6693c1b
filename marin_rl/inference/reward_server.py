"""Reward-model servers and their client: a reward model (`marin_rl.model.reward`) scoring token sequences over HTTP.

    POST /v1/rewards  {"items": [{"prompt_ids": [...], "completion_ids": [...]}, ...]}
                   -> {"rewards": [float, ...], "model": NAME, "backend_s": seconds}
    GET  /health      {"status": "healthy", "model": NAME, "max_seq_len": N, "vocab_size": V}
    GET  /v1/stats    the server's counters

An item's reward is the model's score of `prompt_ids + completion_ids` (the head's output after its last token,
through the checkpoint's output transform). Like the policy servers, a server batches concurrent requests: a batch
grows while requests keep arriving less than `batch_timeout_s` apart (at most 10 times that after its first, and
`max_batch_rows` sequences), and is scored in jitted calls whose inputs are padded to a few fixed shapes (`row_buckets`
× `length_buckets`), so a request never triggers a compilation once every shape has been seen. Bad input is a 400
naming the item and what is wrong: no items, an empty sequence, more tokens than the model's `max_seq_len`, a token id
outside the vocabulary, or a body that is not of this form.

`RewardClient` (httpx, async) sends requests to the server with the fewest outstanding ones; `score_one` coalesces
the items submitted in one turn of the event loop into one request (a group's completions travel together).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import haliax as hax
import httpx
import jax
import jax.numpy as jnp
import numpy as np
from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from marin_rl.inference.config import RewardModelConfig
from marin_rl.inference.http_server import HttpServerThread, client_limits, next_batch, resolve_future
from marin_rl.model.reward import RewardModelSpec, load_reward_model, sequence_rewards
from marin_rl.model.value import ValueModel

logger = logging.getLogger(__name__)


class RewardItem(BaseModel):
    """One sequence to score: the prompt's token ids and the completion's (scored as one sequence)."""

    prompt_ids: list[int] = []
    completion_ids: list[int] = []


class RewardRequest(BaseModel):
    """A scoring request: one or more items."""

    items: list[RewardItem]


def default_buckets(limit: int, start: int, factor: int) -> list[int]:
    """`start`, `start·factor`, ... below `limit`, then `limit`."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= factor
    return [*out, limit]


def bucket_for(buckets: list[int], n: int) -> int:
    """The smallest bucket holding `n`."""
    return buckets[bisect.bisect_left(buckets, n)]


class _Job:
    """Sequences of one request waiting to be scored, and where their rewards go."""

    def __init__(self, sequences: list[list[int]], future: asyncio.Future):
        self.sequences = sequences
        self.future = future
        self.rewards: list[float | None] = [None] * len(sequences)
        self.left = len(sequences)


class RewardServer:
    """A reward model behind `POST /v1/rewards` (see the module docstring). Run it in-process or in a Ray actor."""

    def __init__(self, model: ValueModel, spec: RewardModelSpec, config: RewardModelConfig, name: str | None = None):
        self.spec = spec
        self.config = config
        self.name = name or f"{config.name}-0"
        self.model = jax.tree_util.tree_map(lambda x: jax.device_put(x) if eqx.is_array(x) else x, model)
        self.max_seq_len = spec.max_seq_len
        self.vocab_size = spec.vocab_size
        self.length_buckets = sorted(
            {b for b in (config.length_buckets or default_buckets(self.max_seq_len, 16, 2)) if b < self.max_seq_len}
            | {self.max_seq_len}
        )
        self.row_buckets = sorted(
            {
                b
                for b in (config.row_buckets or default_buckets(config.max_batch_rows, 1, 4))
                if b < config.max_batch_rows
            }
            | {config.max_batch_rows}
        )
        output = spec.output

        def score(model, ids, lengths):
            Batch, Pos = hax.Axis("batch", ids.shape[0]), hax.Axis("position", ids.shape[1])
            named = hax.named(ids, (Batch, Pos))
            return sequence_rewards(model, named, hax.named(lengths, (Batch,)), output).array

        self._score = eqx.filter_jit(score)
        self._queue: queue.Queue[_Job] = queue.Queue()
        self._shutdown = threading.Event()
        self._thread = threading.Thread(target=self._batch_loop, name=f"{self.name}-batches", daemon=True)
        self._thread.start()
        self.counters = {
            "requests": 0,
            "rejected": 0,
            "items": 0,
            "batches": 0,
            "device_calls": 0,
            "tokens": 0,
            "padded_tokens": 0,
            "device_s": 0.0,
            "backend_s": 0.0,
        }
        self.shapes: set[tuple[int, int]] = set()
        """(rows, length) shapes scored so far (each compiled once)."""
        self.app = reward_app(self)
        self._http = HttpServerThread(config.host, self.name)

    @classmethod
    def from_checkpoint(cls, config: RewardModelConfig, name: str | None = None) -> RewardServer:
        """A server of the checkpoint at `config.path` (FileNotFoundError / ValueError from `load_reward_model`)."""
        model, spec = load_reward_model(config.path)
        return cls(model, spec, config, name)

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self, port: int = 0) -> str:
        """Serve in a background thread; returns the advertised 'host:port' once it accepts connections."""
        return self._http.start(self.app, port)

    def stop(self) -> None:
        """Stop the HTTP server and the batching thread."""
        self._http.stop()
        self._shutdown.set()
        self._thread.join(timeout=10)

    def stats(self) -> dict[str, Any]:
        """Name, model, counters (requests, items, device calls and seconds, tokens and padding), compiled shapes."""
        return {"name": self.name, "model": self.config.name, **self.counters, "compiled_shapes": len(self.shapes)}

    # ---- scoring ------------------------------------------------------------------------------------
    def check(self, items: Sequence[RewardItem]) -> list[list[int]]:
        """The items' sequences; ValueError naming the first bad item and what is wrong with it."""
        if not items:
            raise ValueError("items: a request needs at least one item")
        out = []
        for i, item in enumerate(items):
            seq = list(item.prompt_ids) + list(item.completion_ids)
            if not seq:
                raise ValueError(f"items[{i}]: empty sequence (prompt_ids and completion_ids are both empty)")
            if len(seq) > self.max_seq_len:
                raise ValueError(
                    f"items[{i}]: {len(seq)} tokens exceed the reward model's max_seq_len={self.max_seq_len}"
                )
            bad = next((t for t in seq if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"items[{i}]: token id {bad} at position {seq.index(bad)} is outside the reward "
                    f"model's vocabulary [0, {self.vocab_size})"
                )
            out.append(seq)
        return out

    async def score(self, sequences: list[list[int]]) -> list[float]:
        """Rewards of checked sequences (`check`), batched with whatever else arrives meanwhile."""
        job = _Job(sequences, asyncio.get_running_loop().create_future())
        self._queue.put(job)
        return await job.future

    def score_now(self, sequences: list[list[int]]) -> list[float]:
        """Rewards of checked sequences, scored at once in this thread (no batching with other requests)."""
        out: list[float] = []
        for start in range(0, len(sequences), self.config.max_batch_rows):
            out += self._device_call(sequences[start : start + self.config.max_batch_rows])
        return out

    def _batch_loop(self) -> None:
        """Score queued jobs in batches of up to `max_batch_rows` sequences (`next_batch`)."""
        timeout = self.config.batch_timeout_s
        cap = self.config.max_batch_rows
        while (jobs := next_batch(self._queue, self._shutdown, timeout, cap, _rows)) is not None:
            try:
                self._run(jobs)
            except Exception as e:  # noqa: BLE001 - every waiting request gets the error
                logger.error("%s: scoring failed: %s", self.name, e, exc_info=True)
                for job in jobs:
                    resolve_future(job.future, error=e)

    def _run(self, jobs: list[_Job]) -> None:
        """Score every sequence of `jobs`: grouped by length bucket, in calls of at most `max_batch_rows` rows."""
        self.counters["batches"] += 1
        by_bucket: dict[int, list[tuple[_Job, int]]] = {}
        for job in jobs:
            for k, seq in enumerate(job.sequences):
                by_bucket.setdefault(bucket_for(self.length_buckets, len(seq)), []).append((job, k))
        for entries in by_bucket.values():
            for start in range(0, len(entries), self.config.max_batch_rows):
                chunk = entries[start : start + self.config.max_batch_rows]
                rewards = self._device_call([job.sequences[k] for job, k in chunk])
                for (job, k), r in zip(chunk, rewards, strict=True):
                    job.rewards[k] = r
                    job.left -= 1
                    if job.left == 0:
                        resolve_future(job.future, list(job.rewards))

    def _device_call(self, sequences: list[list[int]]) -> list[float]:
        """One jitted call on `sequences` (at most `max_batch_rows`), padded to a (rows, length) bucket."""
        rows = bucket_for(self.row_buckets, len(sequences))
        length = bucket_for(self.length_buckets, max(len(s) for s in sequences))
        ids = np.zeros((rows, length), np.int32)
        lengths = np.ones(rows, np.int32)  # padding rows: one pad token, scored and dropped
        for i, s in enumerate(sequences):
            ids[i, : len(s)] = s
            lengths[i] = len(s)
        start = time.perf_counter()
        out = np.asarray(self._score(self.model, jnp.asarray(ids), jnp.asarray(lengths)))
        self.counters["device_s"] += time.perf_counter() - start
        self.counters["device_calls"] += 1
        self.counters["tokens"] += int(sum(len(s) for s in sequences))
        self.counters["padded_tokens"] += rows * length
        self.shapes.add((rows, length))
        return [float(x) for x in out[: len(sequences)]]


def reward_app(server: RewardServer) -> FastAPI:
    """The FastAPI app of a reward server: `/v1/rewards`, `/v1/stats`, `/health`; malformed bodies are 400s."""
    app = FastAPI(title=f"marin_rl reward server {server.name}")
    counts = server.counters

    @app.exception_handler(RequestValidationError)
    async def malformed(request, exc: RequestValidationError):
        counts["rejected"] += 1
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors())
        return JSONResponse({"detail": f"malformed request: {problems}"}, status_code=400)

    @app.get("/health")
    async def health():
        return {
            "status": "healthy",
            "model": server.config.name,
            "max_seq_len": server.max_seq_len,
            "vocab_size": server.vocab_size,
        }

    @app.get("/v1/stats")
    async def stats():
        return server.stats()

    @app.post("/v1/rewards")
    async def rewards(request: RewardRequest):
        counts["requests"] += 1
        try:
            sequences = server.check(request.items)
        except ValueError as e:
            counts["rejected"] += 1
            raise HTTPException(status_code=400, detail=str(e)) from e
        start = time.perf_counter()
        values = await server.score(sequences)
        backend_s = time.perf_counter() - start
        counts["items"] += len(sequences)
        counts["backend_s"] += backend_s
        return JSONResponse({"rewards": values, "model": server.config.name, "backend_s": backend_s})

    return app


class RewardRequestError(ValueError):
    """A reward server refused a request as bad input (HTTP 400); the message is the server's."""


class RewardClient:
    """Scores (prompt_ids, completion_ids) pairs on reward servers of one model (see the module docstring).

    The HTTP client is made per event loop at first use, so one `RewardClient` serves any loop (e.g. an
    `InferenceEngine`'s and the caller's).
    """

    def __init__(self, servers: Sequence[str], *, name: str = "reward_model", timeout_s: float = 600.0):
        if not servers:
            raise ValueError(f"RewardClient for {name!r} needs at least one server address")
        self.servers = list(servers)
        self.name = name
        self.timeout_s = timeout_s
        self._http: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._outstanding = dict.fromkeys(self.servers, 0)
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[list[int], list[int], asyncio.Future]]] = {}
        self._tasks: set[asyncio.Task] = set()
        self.requests = 0
        """Requests answered."""
        self.items = 0
        """Items scored."""
        self.request_s = 0.0
        """Seconds from sending requests to their answers, summed."""

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if loop not in self._http:
            self._http[loop] = httpx.AsyncClient(timeout=self.timeout_s, limits=client_limits())
        return self._http[loop]

    async def score(self, items: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[float]:
        """The reward of each (prompt_ids, completion_ids), in one request to the least-loaded server; raises
        `RewardRequestError` for a bad item (the server's message) and RuntimeError when no server answers."""
        body = {"items": [{"prompt_ids": list(map(int, p)), "completion_ids": list(map(int, c))} for p, c in items]}
        tried: list[str] = []
        while True:
            server = min((s for s in self.servers if s not in tried), key=lambda s: self._outstanding[s])
            self._outstanding[server] += 1
            start = time.perf_counter()
            try:
                r = await self._client().post(f"http://{server}/v1/rewards", json=body)
            except httpx.TransportError as e:
                tried.append(server)
                if len(tried) == len(self.servers):
                    raise RuntimeError(f"reward model {self.name!r}: no server answers ({self.servers}): {e!r}") from e
                logger.warning("reward server %s cannot be reached (%r); trying another", server, e)
                continue
            finally:
                self._outstanding[server] -= 1
            if r.status_code == 400:
                raise RewardRequestError(f"reward model {self.name!r} ({server}): {r.json().get('detail', r.text)}")
            if r.status_code != 200:
                raise RuntimeError(f"reward model {self.name!r} ({server}): HTTP {r.status_code} {r.text[:500]}")
            values = r.json()["rewards"]
            if len(values) != len(items):
                raise RuntimeError(
                    f"reward model {self.name!r} ({server}) returned {len(values)} rewards for {len(items)} items"
                )
            self.requests += 1
            self.items += len(items)
            self.request_s += time.perf_counter() - start
            return [float(v) for v in values]

    async def score_one(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> float:
        """The reward of one sequence. Items submitted in the same turn of the event loop (e.g. a group's
        completions scored with `asyncio.gather`) go in one request; a refused request is sent again item by item, so
        that each caller gets its own item's answer or error."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        pending = self._pending.setdefault(loop, [])
        pending.append((list(prompt_ids), list(completion_ids), future))
        if len(pending) == 1:
            loop.call_soon(self._start_flush, loop)
        return await future

    def _start_flush(self, loop: asyncio.AbstractEventLoop) -> None:
        task = loop.create_task(self._flush(loop))
        self._tasks.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._tasks.discard)

    async def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        batch = self._pending.pop(loop, [])
        if not batch:
            return
        try:
            values = await self.score([(p, c) for p, c, _ in batch])
        except RewardRequestError as e:
            if len(batch) > 1:  # a bad item refused them all: each caller gets its own item's answer or error
                await asyncio.gather(*(self._one(p, c, f) for p, c, f in batch))
            elif not batch[0][2].done():
                batch[0][2].set_exception(e)
            return
        except Exception as e:  # noqa: BLE001 - handed to every caller
            for _, _, f in batch:
                if not f.done():
                    f.set_exception(e)
            return
        for (_, _, f), v in zip(batch, values, strict=True):
            if not f.done():
                f.set_result(v)

    async def _one(self, prompt_ids, completion_ids, future: asyncio.Future) -> None:
        try:
            [value] = await self.score([(prompt_ids, completion_ids)])
        except Exception as e:  # noqa: BLE001 - handed to the caller
            if not future.done():
                future.set_exception(e)
            return
        if not future.done():
            future.set_result(value)

    async def aclose(self) -> None:
        """Close this event loop's HTTP client (others are dropped)."""
        loop = asyncio.get_running_loop()
        client = self._http.pop(loop, None)
        self._http.clear()
        if client is not None:
            await client.aclose()


def _rows(job: _Job) -> int:
    """The sequences of a queued job (a batch's size is counted in them)."""
    return len(job.sequences)
