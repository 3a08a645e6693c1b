"""The embedded inference server: Levanter's JAX engine behind the OpenAI dialect of `openai_api`.

It differs from `levanter.inference.openai.InferenceServer` where RL needs exactness:

* token-id prompts, token ids back, `stop_token_ids` and per-choice policy versions (the dialect of `openai_api`,
  which the vLLM front end speaks too, so one client serves both backends);
* several stop sequences stay separate (Levanter's route merges them into one);
* `n > 1` is served as n single-sample requests (the engine's `n > 1` path mis-reports logprobs on long prompts);
* the end-of-sequence token is an explicit stop (the engine stops only at stop sequences and the token limit);
* every engine call holds only what one prefill admits (the engine prefills once per call: requests beyond that
  come back with no tokens), and long generations the engine returns short are continued in the next call;
* logprobs are those of the whole distribution at the sampling temperature (`_FullDistributionSampler`: Levanter's
  nucleus filter drops up to 1e-4 of the tail even at top_p = 1);
* `finish_reason` is 'length' when the token limit was hit;
* a batch keeps growing while concurrent requests keep arriving (Levanter cuts one at a fixed interval, which
  often sends the first request of a burst through a whole decode alone);
* every choice carries the policy versions that sampled its first and last tokens: new weights are applied with
  `apply_weights(version, leaves)` between engine calls (keeping shardings, so nothing recompiles), and long
  generations are decoded in segments of `inference.levanter.segment_tokens`, so one that straddles an update continues
  under the new weights, each token's logprob that of the weights that sampled it (partial rollouts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from levanter.inference.engine import InferenceEngine, InferenceEngineConfig, Request
from levanter.inference.jit_scheduler import SeqDecodingParams
from levanter.inference.openai import InferenceContext, InferenceResponse, InferenceServerConfig
from levanter.inference.utils import INVALID
from levanter.layers.sampler import Sampler
from levanter.models.lm_model import LmHeadModel
from levanter.trainer import TrainerConfig

from marin_rl.broadcast.arrays import cast_on_host
from marin_rl.inference.completion_request import GREEDY_BELOW, InvalidRequest, RequestLimits, seed_key
from marin_rl.inference.config import InferenceConfig
from marin_rl.inference.dense_engine import DenseDecodeParams, DenseEngine
from marin_rl.inference.engine_support import check_paged_supported
from marin_rl.inference.http_server import HttpServerThread, next_batch, resolve_future, resolve_futures
from marin_rl.inference.openai_api import (
    Completion,
    CompletionBackend,
    CompletionRequest,
    FrontEndCounters,
    openai_app,
    warn_if_unprotected,
)
from marin_rl.inference.prompt_scores import PromptScores
from marin_rl.model.config import LoraConfig
from marin_rl.model.logprobs import token_logprobs, top_k_logprobs
from marin_rl.model.lora import AdapterMerger
from marin_rl.model.precision import cast_to_compute

logger = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class _FullDistributionSampler(Sampler):
    """Levanter's sampler, except that `top_p >= 1` samples from (and scores against) the whole distribution.

    Levanter's nucleus filter keeps the smallest prefix whose mass reaches `top_p - 1e-4`, so even at `top_p = 1`
    it drops up to 1e-4 of the tail (those tokens can never be sampled) and reports logprobs renormalised over the
    rest (up to ~1e-4 above the policy's, a bias the learner's importance ratios would see)."""

    def _apply_top_p(self, scaled_logits, top_ps):
        if top_ps is None:
            return scaled_logits
        filtered = super()._apply_top_p(scaled_logits, top_ps)
        if isinstance(top_ps, hax.NamedArray):
            whole = top_ps >= 1.0
        else:
            vocab = scaled_logits.resolve_axis(self.Vocab)
            whole = hax.named(jnp.asarray(top_ps) >= 1.0, tuple(ax for ax in scaled_logits.axes if ax != vocab))
        return hax.where(whole, scaled_logits, filtered)


class _Sequence:
    """One completion in progress: its request, its PRNG key data and stop array (built once, when it starts), the
    tokens and logprobs sampled so far, and their versions."""

    def __init__(self, req, key: np.ndarray, stop):
        self.req = req
        self.key = key
        self.stop = stop
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.token_versions: list[int] = []  # the version that sampled each token
        self.routes: np.ndarray | None = None  # a mixture of experts' routing of the context (`DenseEngine.run`)
        self.done = False
        self.answered = False  # its future resolved (the dense engine answers a sequence as soon as it ends)
        self.error: Exception | None = None

    @property
    def context(self) -> list[int]:
        """Prompt and tokens so far: what the next segment is prefilled with."""
        return list(self.req.prompt_tokens) + self.tokens

    @property
    def remaining(self) -> int:
        """Tokens still allowed."""
        return self.req.max_tokens - len(self.tokens)

    def ends_with_stop(self) -> bool:
        """Whether the sequence (prompt included, as the engine checks it) ends with one of the stop sequences."""
        ctx = self.context
        return any(len(s) and ctx[-len(s) :] == list(s) for s in (self.req.stop_tokens or []) if len(ctx) >= len(s))


class _VersionedContext(InferenceContext):
    """Levanter's inference context, decoding in segments and swapping weights between them.

    A batch of requests is decoded segment by segment: each engine call samples at most `segment_tokens` more
    tokens of every unfinished sequence, prefilling it with its prompt and the tokens sampled so far. Weights
    offered with `swap_weights` are applied between engine calls, so a generation that straddles an update goes
    on under the new weights (its KV cache recomputed by the prefill) and every token's logprob is that of the
    weights that sampled it. The per-position PRNG keys (`fold_in(key(seed), position)`) make a segmented
    generation sample exactly what an unsegmented one would under the same weights.
    """

    def __init__(
        self, model, tokenizer, engine, config, max_stop_seqs: int, max_stop_tokens: int, segment_tokens: int | None
    ):
        super().__init__(model, tokenizer, engine, config)
        self.version = -1
        self.max_stop_seqs = max_stop_seqs
        self.max_stop_tokens = max_stop_tokens
        self.segment_tokens = segment_tokens
        self.num_batches = 0
        self.engine_s = 0.0  # seconds inside engine calls
        self.num_weight_swaps = 0
        self.generated_tokens = 0
        self.scored_tokens = 0  # prompt tokens scored (`LevanterInferenceServer.score`)
        self._rng = np.random.default_rng()
        self._pending_lock = threading.Lock()
        self._pending: tuple[int, Any, threading.Event] | None = None
        self._running = threading.Event()  # cleared while paused
        self._running.set()
        self._engine_idle = threading.Condition()
        self._in_engine_call = False
        self._stop_arrays: dict[tuple, Any] = {}
        self._later: list[_Sequence] = []  # arrived during a dense call that they did not fit: the next call's

    def engine_scope(self) -> contextlib.AbstractContextManager:
        """The mesh and axis mapping that every engine call runs under (Levanter's batch thread enters them): a
        process repeating this server's engine calls (a follower of a multi-host run) enters them too, so that both
        run the same program."""
        stack = contextlib.ExitStack()
        stack.enter_context(hax.partitioning.set_mesh(self.config.trainer.device_mesh))
        stack.enter_context(hax.axis_mapping(self.config.trainer.compute_axis_mapping))
        return stack

    # ---- pause and resume -----------------------------------------------------------------------------------
    def pause(self) -> None:
        """No engine call starts until `resume`; returns once the call in progress (one segment) has finished.
        Requests keep queueing; generations in progress are frozen between segments. Weights offered meanwhile
        are applied (so an update while paused is served from the first segment after `resume`)."""
        self._running.clear()
        with self._engine_idle:
            self._engine_idle.wait_for(lambda: not self._in_engine_call)

    def resume(self) -> None:
        """Let engine calls run again."""
        self._running.set()

    def _wait_while_paused(self) -> None:  # the batch thread, holding self.model_lock
        while not self._running.wait(0.01):
            self._apply_pending_weights()

    # ---- weights --------------------------------------------------------------------------------------------
    def swap_weights(self, version: int, model) -> None:
        """Serve `model` as `version` from the next engine call on; returns once it is being served.

        Waits at most for the engine call in progress (one segment), not for the whole batch. A newer offer
        supersedes one not yet applied.
        """
        applied = threading.Event()
        with self._pending_lock:
            if self._pending is not None:
                self._pending[2].set()  # superseded: its caller returns, this model is served instead
            self._pending = (int(version), model, applied)
        while not applied.is_set():
            # Idle engine: apply it here. Busy engine: the batch thread applies it after the current engine call.
            if self.model_lock.acquire(timeout=0.005):
                try:
                    self._apply_pending_weights()
                finally:
                    self.model_lock.release()

    def _apply_pending_weights(self) -> None:  # the caller holds self.model_lock
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        version, model, applied = pending
        self.model = model
        if self.engine is not None:
            self.engine.model = model  # same structure and shardings: the compiled decode functions are reused
            self.engine.model_version = version
        self.version = version
        self.num_weight_swaps += 1
        applied.set()

    # ---- batching -------------------------------------------------------------------------------------------
    def _inference_loop(self) -> None:
        """Group queued requests into batches: a batch grows while requests keep arriving less than
        `batch_timeout` apart, up to `max_seqs` sequences or `BATCH_WINDOW_CAP` batch timeouts in all.

        Levanter's loop cuts a batch at a fixed interval, so the first of many concurrent requests (an env actor's
        groups, a benchmark's burst) often runs alone: a whole decode of one sequence that costs about as much as a
        full batch, while the others wait.
        """
        timeout = self.config.batch_timeout
        max_seqs = self._engine_max_seqs() if self.engine is not None else 1
        while (batch := next_batch(self.request_queue, self.shutdown_event, timeout, max_seqs)) is not None:
            self.batch_queue.put(batch)

    # ---- decoding -------------------------------------------------------------------------------------------
    def _stop_array(self, stop_seqs: list[list[int]] | None):
        """The engine's [stop_seq, position] array of `stop_seqs` (left padded), shared by requests with the same
        stops (every request of a run, typically: building a named array per request cost ~0.15 ms)."""
        if not stop_seqs:
            return None
        # the front end passes a tuple of tuples (its own cache's): the key as is; other callers' lists are converted
        key = stop_seqs if isinstance(stop_seqs, tuple) else tuple(tuple(int(t) for t in s) for s in stop_seqs)
        if key not in self._stop_arrays:
            self._stop_arrays[key] = self._new_stop_array(stop_seqs)
        return self._stop_arrays[key]

    def _new_stop_array(self, stop_seqs: list[list[int]]):
        if len(stop_seqs) > self.max_stop_seqs or max(len(s) for s in stop_seqs) > self.max_stop_tokens:
            raise ValueError(
                f"at most {self.max_stop_seqs} stop sequences of at most {self.max_stop_tokens} tokens are supported"
            )
        width = max(len(s) for s in stop_seqs)
        arr = np.full((len(stop_seqs), width), INVALID, dtype=np.int32)
        for i, s in enumerate(stop_seqs):
            arr[i, width - len(s) :] = s  # the engine expects left padding
        return hax.named(arr, ("stop_seq", "position"))

    def _drain_batch_queue(self) -> list:
        # Levanter's batching thread cuts a batch every `batch_timeout` even while the engine is busy; take
        # everything that queued up meanwhile so that each engine call is as full as it can be.
        requests: list = []
        while True:
            try:
                requests.extend(self.batch_queue.get_nowait())
            except queue.Empty:
                return requests

    def _start(self, requests) -> list[_Sequence]:
        """The sequences of `requests`, each with what its engine calls need (its key, its stop array). A request
        whose values the engine cannot take fails alone, here, rather than the engine call of every request beside
        it; one whose caller has gone (its future cancelled) is dropped."""
        seqs = []
        for req in requests:
            if req.future.done():
                continue
            try:
                stop = self._stop_array(req.stop_tokens)
                # req.seed: the engine key data of a seeded request (`seed_key`), else None
                key = req.seed if req.seed is not None else seed_key(int(self._rng.integers(0, 2**31 - 1)))
                key = np.asarray(key, dtype=np.uint32).reshape(2)
                if min(req.prompt_tokens) < 0 or max(req.prompt_tokens) > np.iinfo(np.int32).max:
                    raise ValueError("prompt token ids must fit the engine's int32")
            except (ValueError, TypeError, OverflowError) as e:
                resolve_future(req.future, error=ValueError(str(e)))
                continue
            seqs.append(_Sequence(req, key, stop))
        return seqs

    def _execute_batch(self, requests):  # runs under self.model_lock
        if not self.engine:
            raise RuntimeError("Inference engine is not initialized.")
        active = self._start([*requests, *self._drain_batch_queue()])
        try:
            self._apply_pending_weights()
            while active:
                # Levanter's engine prefills once per generate() call: requests beyond what one prefill admits
                # (max_seqs_in_prefill, max_prefill_size) come back with no tokens. So every engine call gets only
                # what one prefill admits. The dense engine takes them all, and more that arrive while it runs.
                max_seqs, max_tokens = self._call_capacity()
                chunk: list[_Sequence] = []
                chunk_tokens = 0
                joined: list[_Sequence] = []  # arrived during an engine call
                for seq in active:
                    n = len(seq.req.prompt_tokens) + len(seq.tokens)
                    if chunk and (len(chunk) >= max_seqs or chunk_tokens + n > max_tokens):
                        self._wait_while_paused()
                        joined += self._decode_segment(chunk)
                        self._apply_pending_weights()
                        chunk, chunk_tokens = [], 0
                    chunk.append(seq)
                    chunk_tokens += n
                if chunk:
                    self._wait_while_paused()
                    joined += self._decode_segment(chunk)
                    self._apply_pending_weights()
                active += joined
                self._respond([seq for seq in active if seq.done])
                # Requests that arrived meanwhile join at the next segment; those whose caller has gone are dropped.
                active = [s for s in active if not s.done and not s.req.future.done()]
                active += self._start(self._drain_batch_queue())
        except Exception as e:
            logger.error("decoding failed: %s", e, exc_info=True)
            for seq in active:
                resolve_future(seq.req.future, error=e)

    def _engine_max_seqs(self) -> int:
        """Sequences the engine holds at once."""
        return self.engine.max_seqs if isinstance(self.engine, DenseEngine) else self.engine.config.max_seqs

    def _call_capacity(self) -> tuple[float, float]:
        """(sequences, prompt tokens) one engine call takes: what the paged engine's prefill admits; the dense engine
        takes any number (sequences beyond its slots wait inside the call for one to free)."""
        if isinstance(self.engine, DenseEngine):
            return float("inf"), float("inf")
        cfg = self.engine.config
        return cfg.max_seqs_in_prefill, cfg.max_prefill_size

    def _engine_request(self, seq: _Sequence, i: int, dense: bool) -> Request:
        """The engine request for `seq`'s next segment: up to `segment_tokens` more tokens after its context."""
        allow = seq.remaining if self.segment_tokens is None else min(self.segment_tokens, seq.remaining)
        context = seq.context
        # Host arrays only: the engine reads these with np.asarray, and an eager JAX op per request costs
        # more than the decoding itself for short completions. seq.key is jax.random.PRNGKey(seed).
        # The dense engine reads the same fields from a plain record: an equinox module's construction cost ~70 µs
        # per sequence, most of this thread's time for short completions.
        params = (DenseDecodeParams if dense else SeqDecodingParams)(
            max_num_tokens=np.int32(len(context) + allow),
            stop_tokens=seq.stop,
            temperature=np.float32(seq.req.temperature),
            top_p=np.float32(1.0),
            key=seq.key,
        )
        return Request(prompt_tokens=context, request_id=i, decode_params=params, n_generations=1)

    def _joining(self, members: list[_Sequence], positions: int) -> list[Request]:
        """Sequences that arrived while the dense engine runs, to join its call (`members` grows by them): none once
        new weights wait, the server is paused or stopping (the call then ends with its sequences' segments). One
        whose segment would not fit the call's `positions` waits for the next call."""
        if self._pending is not None or not self._running.is_set() or self.shutdown_event.is_set():
            return []
        joining = []
        for seq in self._start(self._drain_batch_queue()):
            request = self._engine_request(seq, len(members), dense=True)
            if int(request.decode_params.max_num_tokens) > positions:
                self._later.append(seq)
                continue
            members.append(seq)
            joining.append(request)
        return joining

    def _decode_segment(self, seqs: list[_Sequence]) -> list[_Sequence]:
        """One engine call: up to `segment_tokens` more tokens of each sequence, under the current weights. The
        dense engine of a single process also takes sequences that arrive meanwhile, and answers each as it ends;
        returns those that joined (beside `seqs`)."""
        version = self.version
        dense = isinstance(self.engine, DenseEngine)
        members = list(seqs)
        service_requests = [self._engine_request(seq, i, dense) for i, seq in enumerate(seqs)]
        continuous = dense and self.engine.call_guard is None

        def finished(i: int, new: list[int], lps: list[float], routes) -> None:
            seq = members[i]
            self._extend(seq, version, new, lps, routes)
            if seq.done:
                self._respond([seq])

        with self._engine_idle:
            self._in_engine_call = True
        self.num_batches += 1  # counted as it starts: its sequences may be answered before it returns
        # The engine resets itself at the start of every generate(): nothing of this call leaks into the next.
        engine_start = time.perf_counter()
        try:
            if continuous:
                result = self.engine.generate(
                    service_requests, more=lambda positions: self._joining(members, positions), finished=finished
                )
            else:
                result = self.engine.generate(service_requests)
        except Exception as e:  # the caller fails `seqs`; those that joined are known only here
            for seq in [*members[len(seqs) :], *self._later]:
                resolve_future(seq.req.future, error=e)
            self._later = []
            raise
        finally:
            self.engine_s += time.perf_counter() - engine_start
            with self._engine_idle:
                self._in_engine_call = False
                self._engine_idle.notify_all()
        if not continuous:
            routes = getattr(result, "routes", None)  # the dense engine's (Levanter's engine routes no experts)
            for i, seq in enumerate(seqs):
                lps = list(result.logprobs[i]) if result.logprobs is not None else []
                self._extend(seq, version, list(result.tokens[i]), lps, None if routes is None else routes[i])
        later, self._later = self._later, []
        return members[len(seqs) :] + later

    def _extend(self, seq: _Sequence, version: int, new: list[int], lps: list[float], routes=None) -> None:
        """Add a segment's tokens and logprobs (sampled under `version`) to `seq`; mark it done at a stop sequence
        or its token limit. `routes` (a mixture of experts'): the segment's routing of the whole context, which
        replaces the earlier segments' (its prefill routed their tokens again, under the segment's weights)."""
        if len(lps) != len(new):
            raise RuntimeError(f"engine returned {len(lps)} logprobs for {len(new)} tokens")
        if routes is not None:
            seq.routes = routes
        self.generated_tokens += len(new)
        seq.token_versions += [version] * len(new)
        seq.tokens += new
        seq.logprobs += lps
        stopped = bool(new) and seq.ends_with_stop()
        if stopped or seq.remaining <= 0:
            seq.done = True
        elif not new:
            # The engine finishes a sequence only at a stop sequence or at max_num_tokens; one that ran out of
            # decode rounds (max_seq_len // max_rounds per call) comes back short and continues in the next
            # call, but one that made no progress at all would loop forever.
            seq.error = RuntimeError(f"generation of {seq.req.request_id} made no progress; retry the request")
            seq.done = True

    def _respond(self, seqs: list[_Sequence]) -> None:
        """Answer the finished `seqs` (their texts decoded in one call); each is answered once."""
        seqs = [s for s in seqs if not s.answered]
        for seq in seqs:
            seq.answered = True
        failed = [s for s in seqs if s.error is not None]
        for seq in failed:
            resolve_future(seq.req.future, error=seq.error)
        seqs = [s for s in seqs if s.error is None]
        answers = []
        for seq, text in zip(seqs, self._decode([s.tokens for s in seqs]), strict=True):
            req = seq.req
            out = InferenceResponse(
                request_id=req.request_id,
                text=text,
                tokens=seq.tokens,
                prompt_tokens=len(req.prompt_tokens),
                completion_tokens=len(seq.tokens),
                logprobs=seq.logprobs,
            )
            # the versions travel with the answer (a side table keyed by request id would keep the entries of
            # answers nobody takes: a request whose other choices failed, or whose caller went away)
            answers.append((req.future, (out, list(seq.token_versions), seq.routes)))
        resolve_futures(answers)

    def _decode(self, token_lists: list[list[int]]) -> list[str]:
        """Texts of `token_lists`, special tokens skipped: in one call of a fast tokenizer's Rust backend (the
        Python `decode` cost ~0.3 ms per completion in the batch thread), else one `decode` each."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            texts = backend.decode_batch(token_lists, skip_special_tokens=True)
            if getattr(self.tokenizer, "clean_up_tokenization_spaces", False):  # as `decode` does
                texts = [self.tokenizer.clean_up_tokenization(t) for t in texts]
            return texts
        return [self.tokenizer.decode(t, skip_special_tokens=True) for t in token_lists]


def _on_device_like(old: jax.Array, new) -> jax.Array:
    """`new` placed with `old`'s sharding and cast to `old`'s dtype (a bf16 broadcast moves as bf16).

    Accelerators cast on the device; a CPU device casts with NumPy (several times faster than XLA's CPU convert)
    into an aligned buffer that it then takes without a copy.
    """
    if new.dtype != old.dtype and all(d.platform == "cpu" for d in old.sharding.device_set):
        return jax.device_put(cast_on_host(np.asarray(new), old.dtype), old.sharding)
    x = jax.device_put(new, old.sharding)
    if x.dtype != old.dtype:
        x = x.astype(old.dtype)
    return x


def _replace_leaves(model: LmHeadModel, leaves: list[np.ndarray], name: str) -> LmHeadModel:
    """A copy of `model` whose arrays are `leaves`, each placed with the sharding and dtype of the array it replaces.

    Returns once the arrays are on the devices.
    """
    params, static = eqx.partition(model, eqx.is_array)
    old_leaves, treedef = jax.tree_util.tree_flatten(params)
    if len(old_leaves) != len(leaves):
        raise ValueError(f"{name}: got {len(leaves)} weight arrays, the model has {len(old_leaves)}")
    new_leaves = []
    for i, (old, new) in enumerate(zip(old_leaves, leaves, strict=True)):
        if tuple(old.shape) != tuple(new.shape):
            raise ValueError(f"{name}: weight {i} has shape {tuple(new.shape)}, expected {tuple(old.shape)}")
        new_leaves.append(_on_device_like(old, new))
    jax.block_until_ready(new_leaves)
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, new_leaves), static)


def _prompt_logprobs(model: LmHeadModel, ids: jnp.ndarray, segment_ids: jnp.ndarray, temperature: float) -> jnp.ndarray:
    """Logprob of each token of `(rows, length)` prompts given the tokens before it in its row (0 at position 0),
    at `temperature` (logits / temperature); padding carries segment id -1."""
    axes = (hax.Axis("batch", ids.shape[0]), hax.Axis("position", ids.shape[1]))
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    named = (hax.named(ids, axes), hax.named(positions, axes), hax.named(segment_ids, axes))
    lp, _ = token_logprobs(model, *named, temperature=temperature)
    return lp.array


_score_prompts = eqx.filter_jit(_prompt_logprobs)


def _prompt_top_k(model: LmHeadModel, ids: jnp.ndarray, segment_ids: jnp.ndarray, temperature: float, k: int):
    """`_prompt_logprobs`, and at each position the k most likely tokens with their logprobs (`(rows, length, k)`
    ids and logprobs, of the distribution that predicts that position, at `temperature`)."""
    axes = (hax.Axis("batch", ids.shape[0]), hax.Axis("position", ids.shape[1]))
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    named = (hax.named(ids, axes), hax.named(positions, axes), hax.named(segment_ids, axes))
    lp, top_ids, top_lps = top_k_logprobs(model, *named, k, temperature=temperature)
    return lp.array, top_ids, top_lps


_score_prompts_top_k = eqx.filter_jit(_prompt_top_k)


SCORE_TOKENS = 16384
"""Most token positions (rows × padded length) one scoring forward pass takes."""


def _next_power_of_two(n: int, floor: int) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


class LevanterInferenceServer(CompletionBackend):
    """Levanter's engine serving one policy over HTTP (`openai_api`'s dialect). Run it in-process or as a Ray actor.

    `share_weights`: serve `model`'s own arrays (a colocated learner's) rather than a private copy; later versions
    arrive with `serve_model` (no copy where layouts agree). Otherwise weights arrive as host arrays through
    `apply_weights`."""

    def __init__(
        self,
        model: LmHeadModel,
        tokenizer,
        config: InferenceConfig,
        name: str = "server-0",
        *,
        share_weights: bool = False,
        lora: LoraConfig | None = None,
        compute_dtype: str | None = None,
    ):
        self.config = config
        self.compute_dtype = compute_dtype
        """The dtype the engine computes in (`model.compute_dtype` resolved, e.g. 'bfloat16'): the served weights are
        cast to it once here, and every later version to theirs (`apply_weights`, `serve_model`). None: the model's
        own dtype."""
        model = cast_to_compute(model, compute_dtype)
        self.adapters = AdapterMerger(lora) if lora is not None and lora.enabled else None
        """With LoRA: the base and the merge of each version's adapters into it (`marin_rl.model.lora`)."""
        self.name = name
        self.tokenizer = tokenizer
        self.max_seq_len = config.max_seq_len
        lev = config.levanter
        max_pages_per_seq = -(-config.max_seq_len // lev.page_size)
        max_pages = lev.max_pages or config.max_seqs * max_pages_per_seq
        engine_config = InferenceEngineConfig(
            max_seq_len=config.max_seq_len,
            page_size=lev.page_size,
            max_pages=max_pages,
            max_seqs=config.max_seqs,
            max_rounds=lev.max_rounds,
            max_queued_tokens=max(512, config.max_seqs),
            max_seqs_in_prefill=config.max_seqs,
            max_prefill_size=lev.prefill_tokens,
            compute_dtype=_DTYPES[lev.kv_cache_dtype],
            max_stop_seqs=4,
            max_stop_tokens=16,
        )
        self._server_config = InferenceServerConfig(
            trainer=TrainerConfig(), service=engine_config, batch_timeout=lev.batch_timeout_s
        )
        if not share_weights:
            # Place the first weights exactly as `apply_weights` places later ones (committed arrays with the same
            # shardings), so that swapping weights reuses the compiled decode functions.
            own_leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))]
            model = _replace_leaves(model, own_leaves, name)
        # share_weights: serve `model`'s own arrays (a colocated learner's), and later versions with `serve_model`
        sampler = _FullDistributionSampler(model.Vocab)
        if lev.engine == "dense":
            engine = DenseEngine(
                model,
                sampler,
                max_seqs=config.max_seqs,
                max_seq_len=config.max_seq_len,
                max_stop_seqs=engine_config.max_stop_seqs,
                max_stop_tokens=engine_config.max_stop_tokens,
                cache_dtype=_DTYPES[lev.kv_cache_dtype],
                batch_invariant=lev.batch_invariant,
                record_routing=lev.record_routing,
                decode_steps=lev.max_rounds,
                prefill_tokens=lev.prefill_tokens,
            )
        else:
            check_paged_supported(model)
            with (
                hax.partitioning.set_mesh(self._server_config.trainer.device_mesh),
                hax.axis_mapping(self._server_config.trainer.compute_axis_mapping),
            ):
                engine = InferenceEngine.from_model_with_config(model=model, tokenizer=tokenizer, config=engine_config)
            engine.sampler = sampler
        self.context = _VersionedContext(
            model,
            tokenizer,
            engine,
            self._server_config,
            engine_config.max_stop_seqs,
            engine_config.max_stop_tokens,
            lev.segment_tokens,
        )
        self.context.start()
        self.limits = RequestLimits(
            vocab_size=model.Vocab.size,
            max_seq_len=config.max_seq_len,
            max_n=config.max_n,
            max_prompts=config.max_prompts,
            max_stop_sequences=engine_config.max_stop_seqs,
            max_stop_tokens=engine_config.max_stop_tokens,
            full_distribution_only=True,
        )
        self.api_key = config.api_key
        self._stop_cache: dict[tuple, tuple[tuple[int, ...], ...]] = {}
        self.counters = FrontEndCounters()
        self.app = openai_app(self, "marin_rl embedded inference server", self.counters)
        self._http_server = HttpServerThread(self.config.host, self.name)

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self, port: int = 0) -> str:
        """Start serving in a background thread; returns 'host:port'."""
        address = self._http_server.start(self.app, port)  # `app` as it is now (tests may wrap it)
        warn_if_unprotected(self.name, self._http_server.host, self.api_key)
        return address

    def stop(self) -> None:
        """Stop the HTTP server and the engine threads."""
        self._http_server.stop()
        self.context.shutdown()

    # ---- weights ------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Policy version of the weights being served (-1 before any `apply_weights`)."""
        return self.context.version

    def apply_weights(self, version: int, leaves: list[np.ndarray]) -> float:
        """Serve new parameters (flattened like `eqx.filter(model, eqx.is_array)`) as `version`.

        The arrays are placed on the devices while decoding goes on, each with the sharding of the one it replaces
        (so nothing recompiles) and cast to its dtype (so a bf16 broadcast is served at the model's precision);
        the swap happens between two engine calls. Generations in progress continue under the new weights from
        their next segment (`inference.levanter.segment_tokens`). Any version is applied, lower ones too. Returns
        the seconds until the new weights were being served.
        """
        start = time.time()
        model = None if self.adapters is None else self.adapters.apply(self.context.model, leaves)
        if model is None:  # a plain policy's arrays
            model = _replace_leaves(self.context.model, leaves, self.name)
        else:
            jax.block_until_ready(model)
        self.context.swap_weights(version, model)
        return time.time() - start

    def serve_model(self, version: int, model: LmHeadModel) -> dict[str, float]:
        """Serve `model`, a policy of the served structure whose arrays live on this process's devices (a colocated
        learner's own parameters), as `version`, from the next engine call on.

        No array is copied where its sharding is the one served now (the learner's and the engine's layouts agree):
        the engine reads the learner's buffers, which the learner's step never donates. An array laid out otherwise
        is resharded device to device (never through the host) to the served layout, and cast on the device to the
        served dtype. Returns `bytes` copied, `arrays` copied and `apply_s` (seconds until it was being served)."""
        start = time.time()
        served = eqx.filter(self.context.model, eqx.is_array)
        params, static = eqx.partition(model, eqx.is_array)
        old_leaves = jax.tree_util.tree_leaves(served)
        new_leaves, treedef = jax.tree_util.tree_flatten(params)
        if len(old_leaves) != len(new_leaves):
            raise ValueError(f"{self.name}: got {len(new_leaves)} weight arrays, the model has {len(old_leaves)}")
        copied_bytes, copied = 0, 0
        leaves = []
        for i, (old, new) in enumerate(zip(old_leaves, new_leaves, strict=True)):
            if tuple(old.shape) != tuple(new.shape):
                raise ValueError(f"{self.name}: weight {i} has shape {tuple(new.shape)}, expected {tuple(old.shape)}")
            if new.dtype != old.dtype or not new.sharding.is_equivalent_to(old.sharding, old.ndim):
                new = jax.device_put(new, old.sharding)
                if new.dtype != old.dtype:
                    new = new.astype(old.dtype)
                copied_bytes += int(new.size) * new.dtype.itemsize
                copied += 1
            leaves.append(new)
        model = eqx.combine(jax.tree_util.tree_unflatten(treedef, leaves), static)
        self.context.swap_weights(version, model)
        return {"bytes": float(copied_bytes), "arrays": float(copied), "apply_s": time.time() - start}

    def pause(self) -> None:
        """Stop sampling once the engine call in progress ends (requests wait; see `_VersionedContext.pause`)."""
        self.context.pause()

    def resume(self) -> None:
        """Continue sampling after `pause`."""
        self.context.resume()

    # ---- serving ------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Name, served version, engine calls and their seconds, weight swaps, sampled tokens, and the front end's
        request counts and seconds (busy: with a request in progress; backend: summed over requests)."""
        return {
            "name": self.name,
            "backend": "levanter",
            "version": self.version,
            "batches": self.context.num_batches,
            "weight_swaps": self.context.num_weight_swaps,
            "generated_tokens": self.context.generated_tokens,
            "scored_tokens": self.context.scored_tokens,
            "requests": self.counters.requests,
            "outstanding_requests": self.counters.outstanding,
            "busy_s": self.counters.busy_s,
            "backend_s": self.counters.backend_s,
            "engine_s": self.context.engine_s,
            "paused": not self.context._running.is_set(),
        }

    def _stop_sequences(self, strings: tuple[str, ...], token_ids: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """The token sequences that stop a generation: each stop string's tokens, then each stop id alone (cached
        per request shape: every request of a run typically has the same stops)."""
        key = (strings, token_ids)
        cached = self._stop_cache.get(key)
        if cached is None:
            seqs = [tuple(self.tokenizer(s, add_special_tokens=False)["input_ids"]) for s in strings]
            cached = tuple(s for s in seqs if s) + tuple((int(t),) for t in token_ids)
            if len(self._stop_cache) < 1024:
                self._stop_cache[key] = cached
        return cached

    async def score(self, prompts: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Each prompt's token logprobs after its first token (one forward pass of the served weights over the
        prompts, padded to power-of-two rows and lengths so that few shapes compile), between two engine calls."""
        self._check_score_temperature(temperature)
        return [s.logprobs for s in await asyncio.to_thread(self._score_now, prompts, temperature, 0)]

    async def score_top_k(self, prompts: list[list[int]], temperature: float, k: int) -> list[PromptScores]:
        """`score`, and the k most likely tokens at each position after the first with their logprobs, from the
        same forward pass (exact: the whole distribution of logits / temperature)."""
        self._check_score_temperature(temperature)
        if not 1 <= k <= self.context.model.Vocab.size:
            raise InvalidRequest(f"logprobs must be between 1 and the vocabulary's size, got {k}", "logprobs")
        return await asyncio.to_thread(self._score_now, prompts, temperature, k)

    @staticmethod
    def _check_score_temperature(temperature: float) -> None:
        if not temperature >= GREEDY_BELOW:
            raise InvalidRequest(
                f"a scoring request needs a temperature >= {GREEDY_BELOW}, got {temperature}", "temperature"
            )

    def _score_now(self, prompts: list[list[int]], temperature: float, k: int) -> list[PromptScores]:
        length = min(_next_power_of_two(max(len(p) for p in prompts), 16), self.max_seq_len)
        # at most SCORE_TOKENS positions per forward pass: the logits over the vocabulary are materialised
        chunk = max(1, 1 << ((SCORE_TOKENS // length).bit_length() - 1)) if length <= SCORE_TOKENS else 1
        out: list[PromptScores] = []
        for start in range(0, len(prompts), chunk):
            part = prompts[start : start + chunk]
            rows = _next_power_of_two(len(part), 1)
            ids = np.zeros((rows, length), np.int32)
            segments = np.full((rows, length), -1, np.int32)
            for i, p in enumerate(part):
                ids[i, : len(p)] = p
                segments[i, : len(p)] = 0
            with self.context.model_lock, self.context.engine_scope():
                args = (jnp.asarray(ids), jnp.asarray(segments), float(temperature))  # static: one compile each
                if k:
                    lp, top_ids, top_lps = (np.asarray(x) for x in _score_prompts_top_k(self.context.model, *args, k))
                else:
                    lp = np.asarray(_score_prompts(self.context.model, *args))
            for i, p in enumerate(part):
                scores = PromptScores([float(x) for x in lp[i, 1 : len(p)]])
                if k:
                    scores.top_ids = top_ids[i, 1 : len(p)].astype(np.int32)
                    scores.top_logprobs = top_lps[i, 1 : len(p)].astype(np.float32)
                out.append(scores)
        self.context.scored_tokens += sum(len(p) for p in prompts)
        return out

    async def complete(self, request: CompletionRequest, prompts: list[list[int]]) -> list[Completion]:
        """`request.n` single-sample engine requests per prompt (the engine's own `n > 1` mis-reports logprobs on
        long prompts); several stop strings stay separate, `stop_token_ids` are single-token stops. Choice k of a
        seeded request samples with `seed_key(seed, k)`. `request` and `prompts` are `check_request`'s."""
        stop_seqs = self._stop_sequences(tuple(request.stop_strings), tuple(request.stop_token_ids or ()))
        temperature = request.temperature if request.temperature >= GREEDY_BELOW else 0.0
        jobs = []
        for prompt in prompts:
            max_tokens = min(request.max_tokens, self.config.max_seq_len - len(prompt))
            for k in range(request.n):
                fut: asyncio.Future = asyncio.get_running_loop().create_future()
                key = None if request.seed is None else seed_key(request.seed, k)
                self.context.submit_request(
                    prompt_tokens=prompt,
                    max_tokens=max_tokens,
                    temperature=temperature,
                    top_p=None,
                    stop_tokens=stop_seqs,  # type: ignore[arg-type]  # a list of sequences, see _execute_batch
                    seed=key,  # type: ignore[arg-type]  # the engine's key data, see _VersionedContext._start
                    future=fut,
                    n_generations=1,
                )
                jobs.append((fut, max_tokens))
        results = await asyncio.gather(*(f for f, _ in jobs))
        stop_set = set(stop_seqs)
        out = []
        for (_, max_tokens), (gen, versions, routes) in zip(jobs, results, strict=True):
            tokens = list(gen.tokens)
            stopped = any(tuple(tokens[-len(s) :]) == s for s in stop_set if len(tokens) >= len(s))
            finish = "length" if (len(tokens) >= max_tokens and not stopped) else "stop"
            out.append(
                Completion(
                    token_ids=tokens,
                    sampler_logprobs=[float(x) for x in gen.logprobs],
                    text=gen.text,
                    finish_reason=finish,
                    token_versions=list(versions),
                    routed_experts=routes if request.return_routed_experts else None,
                )
            )
        return out
