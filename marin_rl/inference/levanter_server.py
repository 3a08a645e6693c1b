"""The embedded inference server: Levanter's JAX engine behind an OpenAI-compatible HTTP API.

It differs from `levanter.inference.openai.InferenceServer` where RL needs exactness:

* prompts may be token ids (`prompt: [1, 2, 3]`), so nothing is re-tokenized between sampling and training;
* `return_tokens_as_token_ids` and `stop_token_ids` behave as in vLLM, so one client serves both backends;
* several stop sequences stay separate (Levanter's route merges them into one);
* `n > 1` is served as n single-sample requests (the engine's `n > 1` path mis-reports logprobs on long prompts);
* `finish_reason` is 'length' when the token limit was hit;
* every choice carries the policy version of the weights that generated it, and new weights are applied with
  `apply_weights(version, leaves)` between decode batches, keeping shardings so nothing recompiles.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import uvicorn
from fastapi import FastAPI, HTTPException
from levanter.inference.engine import InferenceEngine, InferenceEngineConfig, Request
from levanter.inference.jit_scheduler import SeqDecodingParams
from levanter.inference.openai import InferenceContext, InferenceResponse, InferenceServerConfig
from levanter.inference.utils import INVALID
from levanter.models.lm_model import LmHeadModel
from levanter.trainer import TrainerConfig
from pydantic import BaseModel, Field

from marin_rl.inference.config import InferenceConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class CompletionRequest(BaseModel):
    """OpenAI completions request, plus vLLM's `stop_token_ids` and `return_tokens_as_token_ids`."""

    model: str = "policy"
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = 16
    temperature: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    seed: int | None = None
    return_tokens_as_token_ids: bool = False
    top_p: float | None = Field(default=None, description="Accepted for compatibility; only 1.0 is supported.")


class _VersionedContext(InferenceContext):
    """Levanter's inference context, recording the policy version each request was generated with."""

    def __init__(self, model, tokenizer, engine, config, max_stop_seqs: int, max_stop_tokens: int):
        super().__init__(model, tokenizer, engine, config)
        self.version = -1
        self.request_versions: dict[str, int] = {}
        self.max_stop_seqs = max_stop_seqs
        self.max_stop_tokens = max_stop_tokens
        self.num_batches = 0
        self.generated_tokens = 0
        self._rng = np.random.default_rng()

    def _stop_array(self, stop_seqs: list[list[int]] | None):
        if not stop_seqs:
            return None
        if len(stop_seqs) > self.max_stop_seqs or max(len(s) for s in stop_seqs) > self.max_stop_tokens:
            raise ValueError(
                f"at most {self.max_stop_seqs} stop sequences of at most {self.max_stop_tokens} tokens are supported"
            )
        width = max(len(s) for s in stop_seqs)
        arr = np.full((len(stop_seqs), width), INVALID, dtype=np.int32)
        for i, s in enumerate(stop_seqs):
            arr[i, width - len(s) :] = s  # the engine expects left padding
        return hax.named(arr, ("stop_seq", "position"))

    def _execute_batch(self, requests):  # runs under self.model_lock: weights cannot change meanwhile
        if not self.engine:
            raise RuntimeError("Inference engine is not initialized.")
        # Levanter's decode loop stops after max_seq_len / max_rounds outer rounds, and admits at most one prefill
        # per round; sequences admitted late are then left unfinished inside the engine, and their tokens leak
        # into the next call's requests. So every engine call gets only what one prefill admits.
        # Levanter's batching thread cuts a batch every `batch_timeout` even while the engine is busy; merge
        # everything that queued up meanwhile so that each engine call is as full as it can be.
        requests = list(requests)
        while True:
            try:
                requests.extend(self.batch_queue.get_nowait())
            except queue.Empty:
                break
        cfg = self.engine.config
        chunk: list = []
        chunk_tokens = 0
        for req in requests:
            n = len(req.prompt_tokens)
            if chunk and (len(chunk) >= cfg.max_seqs_in_prefill or chunk_tokens + n > cfg.max_prefill_size):
                self._generate(chunk)
                chunk, chunk_tokens = [], 0
            chunk.append(req)
            chunk_tokens += n
        if chunk:
            self._generate(chunk)

    def _generate(self, requests) -> None:
        version = self.version
        service_requests = []
        for i, req in enumerate(requests):
            self.request_versions[req.request_id] = version
            seed = req.seed if req.seed is not None else int(self._rng.integers(0, 2**31 - 1))
            # Host arrays only: the engine reads these with np.asarray, and an eager JAX op per request costs
            # more than the decoding itself for short completions. [0, seed] is jax.random.PRNGKey(seed).
            params = SeqDecodingParams(
                max_num_tokens=np.int32(len(req.prompt_tokens) + req.max_tokens),
                stop_tokens=self._stop_array(req.stop_tokens),
                temperature=np.float32(req.temperature),
                key=np.array([0, seed], dtype=np.uint32),
            )
            service_requests.append(
                Request(
                    prompt_tokens=req.prompt_tokens,
                    request_id=i,
                    decode_params=params,
                    n_generations=1,
                    enable_logprobs=True,
                )
            )
        result = self.engine.generate(service_requests)
        self.num_batches += 1
        self.generated_tokens += int(result.total_generated)
        stale = bool(self.engine.request_queue) or len(self.engine.free_slots) < self.engine.config.max_seqs
        if stale:
            # Defensive: never let unfinished sequences leak into later calls.
            logger.error("engine left %d sequences unfinished; resetting it", len(self.engine.local_map))
            self.engine.request_queue.clear()
            self.engine.reset()
        for i, req in enumerate(requests):
            tokens = list(result.tokens[i])
            stopped = any(
                tokens[-len(s) :] == list(s) for s in (req.stop_tokens or []) if len(s) and len(tokens) >= len(s)
            )
            if stale and not stopped and len(tokens) < req.max_tokens:
                err = RuntimeError(f"generation of {req.request_id} did not finish; retry the request")
                req.future.get_loop().call_soon_threadsafe(req.future.set_exception, err)
                continue
            out = InferenceResponse(
                request_id=req.request_id,
                text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                tokens=tokens,
                prompt_tokens=len(req.prompt_tokens),
                completion_tokens=len(tokens),
                logprobs=list(result.logprobs[i]) if result.logprobs is not None else None,
            )
            req.future.get_loop().call_soon_threadsafe(req.future.set_result, [out])


def _replace_leaves(model: LmHeadModel, leaves: list[np.ndarray], name: str) -> LmHeadModel:
    """A copy of `model` whose arrays are `leaves`, each placed with the sharding of the array it replaces."""
    params, static = eqx.partition(model, eqx.is_array)
    old_leaves, treedef = jax.tree_util.tree_flatten(params)
    if len(old_leaves) != len(leaves):
        raise ValueError(f"{name}: got {len(leaves)} weight arrays, the model has {len(old_leaves)}")
    new_leaves = []
    for i, (old, new) in enumerate(zip(old_leaves, leaves, strict=True)):
        if tuple(old.shape) != tuple(new.shape):
            raise ValueError(f"{name}: weight {i} has shape {tuple(new.shape)}, expected {tuple(old.shape)}")
        new_leaves.append(jax.device_put(np.asarray(new, dtype=old.dtype), old.sharding))
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, new_leaves), static)


class LevanterInferenceServer:
    """Levanter's engine serving one policy over HTTP. Run it in-process or as a Ray actor."""

    def __init__(self, model: LmHeadModel, tokenizer, config: InferenceConfig, name: str = "server-0"):
        self.config = config
        self.name = name
        self.tokenizer = tokenizer
        max_pages_per_seq = -(-config.max_seq_len // config.page_size)
        max_pages = config.max_pages or config.max_seqs * max_pages_per_seq
        engine_config = InferenceEngineConfig(
            max_seq_len=config.max_seq_len,
            page_size=config.page_size,
            max_pages=max_pages,
            max_seqs=config.max_seqs,
            max_rounds=config.max_rounds,
            max_queued_tokens=max(512, config.max_seqs),
            max_seqs_in_prefill=config.max_seqs,
            max_prefill_size=config.prefill_tokens,
            compute_dtype=_DTYPES[config.kv_cache_dtype],
            enable_logprobs=True,
            max_stop_seqs=4,
            max_stop_tokens=16,
        )
        self._server_config = InferenceServerConfig(
            trainer=TrainerConfig(), service=engine_config, batch_timeout=config.batch_timeout_s
        )
        # Build the first engine exactly as `reload` builds later ones (committed arrays, same mesh and axis
        # mapping), so that applying new weights reuses the compiled decode functions.
        own_leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))]
        model = _replace_leaves(model, own_leaves, name)
        with (
            hax.partitioning.set_mesh(self._server_config.trainer.device_mesh),
            hax.axis_mapping(self._server_config.trainer.compute_axis_mapping),
        ):
            engine = InferenceEngine.from_model_with_config(model=model, tokenizer=tokenizer, config=engine_config)
        self.context = _VersionedContext(
            model, tokenizer, engine, self._server_config, engine_config.max_stop_seqs, engine_config.max_stop_tokens
        )
        self.context.start()
        self.app = self._make_app()
        self._uvicorn: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._outstanding = 0

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self, port: int = 0) -> str:
        """Start serving in a background thread; returns 'host:port'."""
        cfg = uvicorn.Config(self.app, host=self.config.host, port=port, log_level="warning", access_log=False)
        self._uvicorn = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._uvicorn.run, name=f"{self.name}-http", daemon=True)
        self._thread.start()
        deadline = time.time() + 60
        while not self._uvicorn.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"{self.name}: HTTP server failed to start")
            time.sleep(0.02)
        sock = self._uvicorn.servers[0].sockets[0].getsockname()
        return f"{sock[0]}:{sock[1]}"

    def stop(self) -> None:
        """Stop the HTTP server and the engine threads."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=10)
        self.context.shutdown()

    # ---- weights ------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Policy version of the weights being served (-1 before any `apply_weights`)."""
        return self.context.version

    def apply_weights(self, version: int, leaves: list[np.ndarray]) -> float:
        """Swap in new parameters (flattened like `eqx.filter(model, eqx.is_array)`), between decode batches.

        Returns the seconds it took. Each array is placed with the sharding of the one it replaces, so the
        engine's compiled functions are reused.
        """
        start = time.time()

        def callback(old_model):
            model = _replace_leaves(old_model, leaves, self.name)
            self.context.version = int(version)
            return model

        self.context.reload(callback)
        return time.time() - start

    # ---- HTTP ---------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "batches": self.context.num_batches,
            "generated_tokens": self.context.generated_tokens,
            "outstanding_requests": self._outstanding,
        }

    def _make_app(self) -> FastAPI:
        app = FastAPI(title="marin_rl embedded inference server")

        @app.get("/health")
        async def health():
            return {"status": "healthy", "version": self.version}

        @app.get("/v1/version")
        async def version():
            return {"version": self.version}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "marin_rl"}]}

        @app.post("/v1/completions")
        async def completions(request: CompletionRequest):
            self._outstanding += 1
            try:
                return await self._complete(request)
            except ValueError as e:
                raise HTTPException(status_code=400, detail=str(e)) from e
            finally:
                self._outstanding -= 1

        return app

    def _prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        out = []
        for p in prompt:
            ids = self.tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p)
            if not ids:
                raise ValueError("empty prompt")
            if len(ids) >= self.config.max_seq_len:
                raise ValueError(f"prompt of {len(ids)} tokens exceeds max_seq_len={self.config.max_seq_len}")
            out.append(ids)
        return out

    async def _complete(self, request: CompletionRequest) -> dict[str, Any]:
        if request.top_p not in (None, 1.0):
            raise ValueError("top_p is not supported by the embedded server")
        if request.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        prompts = self._prompts(request.prompt)
        stop_seqs: list[list[int]] = []
        stops = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
        for s in stops:
            ids = self.tokenizer(s, add_special_tokens=False)["input_ids"]
            if ids:
                stop_seqs.append(ids)
        stop_seqs += [[t] for t in (request.stop_token_ids or [])]
        start = time.time()
        jobs = []
        for prompt in prompts:
            max_tokens = min(request.max_tokens, self.config.max_seq_len - len(prompt))
            for k in range(request.n):
                fut: asyncio.Future = asyncio.get_running_loop().create_future()
                seed = None if request.seed is None else request.seed + k
                rid = self.context.submit_request(
                    prompt_tokens=prompt,
                    max_tokens=max_tokens,
                    temperature=request.temperature,
                    stop_tokens=stop_seqs,  # type: ignore[arg-type]  # a list of sequences, see _execute_batch
                    seed=seed,
                    future=fut,
                    n_generations=1,
                    enable_logprobs=True,
                )
                jobs.append((rid, fut, max_tokens))
        results = await asyncio.gather(*(f for _, f, _ in jobs))
        stop_set = {tuple(s) for s in stop_seqs}
        choices = []
        total_completion = 0
        for idx, ((rid, _, max_tokens), [gen]) in enumerate(zip(jobs, results, strict=True)):
            version = self.context.request_versions.pop(rid, self.version)
            tokens = gen.tokens
            stopped = any(tuple(tokens[-len(s) :]) == s for s in stop_set if len(tokens) >= len(s))
            finish = "length" if (len(tokens) >= max_tokens and not stopped) else "stop"
            logprobs = None
            if request.logprobs is not None:
                if request.return_tokens_as_token_ids:
                    token_strs = [f"token_id:{t}" for t in tokens]
                else:
                    token_strs = self.tokenizer.convert_ids_to_tokens(tokens)
                logprobs = {
                    "tokens": token_strs,
                    "token_logprobs": [float(x) for x in gen.logprobs],
                    "text_offset": None,
                    "top_logprobs": None,
                }
            choices.append(
                {
                    "index": idx,
                    "text": gen.text,
                    "finish_reason": finish,
                    "logprobs": logprobs,
                    "policy_version_start": version,
                    "policy_version_end": version,
                }
            )
            total_completion += len(tokens)
        total_prompt = sum(len(p) for p in prompts) * request.n
        return {
            "id": f"cmpl-{uuid.uuid4().hex[:12]}",
            "object": "text_completion",
            "created": int(start),
            "model": request.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": total_prompt,
                "completion_tokens": total_completion,
                "total_tokens": total_prompt + total_completion,
            },
        }
