"""The completions request every policy server takes, its checks, and OpenAI's shapes for a refusal and an answer.

`check_request` is the one place a request is validated: the HTTP front end (`openai_api.openai_app`) and the
in-process client (`local_client.InProcessPolicyClient`) both call it before a backend sees the request, so a
request is refused (or served) the same way whichever way it came. A refusal is an `InvalidRequest` naming the
field; over HTTP it is a 400 in OpenAI's error shape (`openai_error`):

    {"error": {"message": "...", "type": "invalid_request_error", "param": "<field>", "code": null}}

What is checked, against the server's `RequestLimits`:

* `prompt`: one prompt or a list of at most `max_prompts`; none empty; token ids within the model's vocabulary;
  each shorter than `max_seq_len` (room to sample at least one token);
* `max_tokens`: 1 to `max_seq_len - 1`; a prompt that leaves less room gets what room there is (finish reason
  'length'; both backends cut it so), so a conversation's later turns need not count its tokens;
* `temperature`: finite and >= 0 (0: greedy; below `GREEDY_BELOW`, greedy too, as vLLM samples them);
* `top_p`: in (0, 1], and 1 where the backend samples the whole distribution only;
* `n`: 1 to `max_n`; `logprobs`: 0 to 5 (OpenAI's bound; the sampled token's logprob is returned, `top_logprobs`
  is null); `stop`: at most 4 strings (OpenAI's bound); `stop_token_ids` within the vocabulary; stop sequences
  within the backend's limits where it has them;
* `seed`: any int64 (the embedded engine samples choice k with `seed_key(seed, k)`, a 64-bit key);
* `echo: true` with `max_tokens: 0` and `logprobs` set is a scoring request (OpenAI's legacy prompt logprobs, which
  vLLM serves too): nothing is sampled, and each choice carries the prompt's own tokens with the logprob of each
  given the ones before it (`null` for the first), at temperature 1; a prompt may then fill the whole context.
  Its `logprobs` may go up to `MAX_SCORING_LOGPROBS` (20, vLLM's default): k > 0 adds the k most likely tokens at
  every position (`top_logprobs`).
  `echo` is refused otherwise, and `max_tokens: 0` without `echo`;
* OpenAI fields this server does not implement (`stream`, `suffix`, `best_of`, penalties, `logit_bias`)
  are refused unless they ask for the default behaviour; fields unknown to OpenAI are ignored, as vLLM ignores
  them;
* types are strict, as OpenAI's: `"5"`, `5.0` and `true` are not integers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from marin_rl.inference.prompt_scores import MAX_SCORING_LOGPROBS

SERVED_MODEL_NAME = "policy"
"""The model name servers report in `/v1/models` and responses."""

OPENAI_MAX_STOP = 4
"""Stop strings OpenAI accepts in one request."""
OPENAI_MAX_LOGPROBS = 5
"""The largest `logprobs` OpenAI's completions accept."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily (vLLM's `_SAMPLING_EPS`): dividing float32 logits by a smaller one can
overflow, which left a sampled token's logprob NaN."""


class CompletionRequest(BaseModel):
    """OpenAI completions request, plus vLLM's `stop_token_ids`, `return_token_ids` and `return_tokens_as_token_ids`.

    Values are checked against a server's limits by `check_request`; the model itself only checks types (strictly).
    """

    model_config = ConfigDict(strict=True)

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
    return_routed_experts: bool = False
    """Each choice carries a mixture-of-experts policy's routing of its prompt and tokens (`routed_experts`,
    `marin_rl.inference.routing_payload`; routing replay). Servers of dense models, and those that cannot record it,
    leave it out."""
    top_p: float | None = Field(default=None, description="Nucleus sampling (backends may support only 1.0).")
    # OpenAI fields that are accepted only with their default behaviour (`UNSUPPORTED_FIELDS`)
    stream: bool | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @property
    def is_scoring(self) -> bool:
        """Whether this asks for the prompt's logprobs only (`echo` with `max_tokens: 0`), sampling nothing."""
        return bool(self.echo) and self.max_tokens == 0

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list (one string, several, or none)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "stream": (None, False),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}
"""OpenAI completions fields this server does not implement, with the values that ask for what it does anyway
(`best_of` is checked apart: it may equal `n`)."""


class InvalidRequest(ValueError):
    """A request the server refuses because of what the client sent: `param` names the field (None: the request as
    a whole), `status` is the HTTP status (400 unless said otherwise)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def openai_error(message: str, *, kind: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def openai_answer(
    kind: str,
    answer_id: str,
    model: str,
    created: float,
    choices: list[dict[str, Any]],
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """OpenAI's answer body (`kind`: 'text_completion' or 'chat.completion') for `choices`, with token usage."""
    return {
        "id": answer_id,
        "object": kind,
        "created": int(created),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


@dataclass(frozen=True)
class RequestLimits:
    """What a server accepts: its model's vocabulary and context, and the bounds of `inference` config."""

    vocab_size: int
    """Token ids must be below this (the model's embedding rows)."""
    max_seq_len: int
    """Prompt + completion tokens one sequence may hold."""
    max_n: int
    """Most choices per prompt (`n`)."""
    max_prompts: int
    """Most prompts in one request."""
    max_stop_sequences: int | None = None
    """Most stop sequences (stop strings plus stop ids) the backend matches, or None: no limit of its own."""
    max_stop_tokens: int | None = None
    """Most tokens in one stop string, tokenized (None: the backend matches strings, not tokens)."""
    full_distribution_only: bool = False
    """The backend samples the whole distribution: `top_p` must be 1 (or absent)."""


PROMPT_FORMS = "a string, a list of token ids, a list of strings or a list of token-id lists"


Model = TypeVar("Model", bound=BaseModel)


def parse_body(model: type[Model], body: bytes | str, refusal: Callable[[dict[str, Any]], InvalidRequest]) -> Model:
    """`model` read from the JSON `body`. Raises `InvalidRequest` for a body that is not JSON or not a JSON object,
    and `refusal(error)` for the first of pydantic's errors otherwise (one with a non-empty `loc`)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            raise InvalidRequest(f"the request body is not valid JSON: {first.get('msg', '')}") from None
        if not first.get("loc"):
            raise InvalidRequest("the request body must be a JSON object") from None
        raise refusal(first) from None


def parse_request(body: bytes | str) -> CompletionRequest:
    """The request in a JSON `body`; raises `InvalidRequest` naming the field whose value has the wrong type (the
    first of them), or for a body that is not a JSON object."""
    return parse_body(CompletionRequest, body, _field_refusal)


def _field_refusal(error: dict[str, Any]) -> InvalidRequest:
    loc = error["loc"]
    field = str(loc[0])
    if field == "prompt" and error["type"] != "missing":
        return InvalidRequest(f"prompt must be {PROMPT_FORMS}", "prompt")
    where = "".join(f"[{x}]" if isinstance(x, int) else "" for x in loc[1:])
    return InvalidRequest(f"{field}{where}: {error['msg']}", field)


def check_request(request: CompletionRequest, tokenizer, limits: RequestLimits) -> list[list[int]]:
    """The token ids of each of `request`'s prompts, once every field is within `limits`; raises `InvalidRequest`
    naming the first field that is not."""
    for name, defaults in UNSUPPORTED_FIELDS.items():
        if getattr(request, name) not in defaults:
            raise InvalidRequest(f"{name} is not supported by this server", name)
    if request.best_of is not None and request.best_of != request.n:
        raise InvalidRequest("best_of is not supported by this server (only best_of equal to n)", "best_of")
    if request.echo and not request.is_scoring:
        raise InvalidRequest(
            "echo is supported only for scoring a prompt: echo: true with max_tokens: 0 and logprobs set", "echo"
        )
    if request.is_scoring:
        return _check_scoring(request, tokenizer, limits)
    if not 1 <= request.n <= limits.max_n:
        raise InvalidRequest(f"n must be between 1 and {limits.max_n}, got {request.n}", "n")
    if not 1 <= request.max_tokens < limits.max_seq_len:
        raise InvalidRequest(
            f"max_tokens must be between 1 and {limits.max_seq_len - 1} (the context is {limits.max_seq_len} "
            f"tokens), got {request.max_tokens}",
            "max_tokens",
        )
    if not (math.isfinite(request.temperature) and request.temperature >= 0):
        raise InvalidRequest(f"temperature must be a finite number >= 0, got {request.temperature}", "temperature")
    if request.top_p is not None:
        if not (math.isfinite(request.top_p) and 0 < request.top_p <= 1):
            raise InvalidRequest(f"top_p must be in (0, 1], got {request.top_p}", "top_p")
        if limits.full_distribution_only and request.top_p != 1:
            raise InvalidRequest("top_p is not supported by this server (it samples the whole distribution)", "top_p")
    if request.logprobs is not None and not 0 <= request.logprobs <= OPENAI_MAX_LOGPROBS:
        raise InvalidRequest(
            f"logprobs must be between 0 and {OPENAI_MAX_LOGPROBS}, got {request.logprobs}", "logprobs"
        )
    if request.seed is not None and not INT64_MIN <= request.seed <= INT64_MAX:
        raise InvalidRequest(f"seed must be a 64-bit signed integer, got {request.seed}", "seed")
    _check_stops(request, tokenizer, limits)
    return _prompt_ids(request.prompt, tokenizer, limits)


def _check_scoring(request: CompletionRequest, tokenizer, limits: RequestLimits) -> list[list[int]]:
    """The prompts of a scoring request (`echo` with `max_tokens: 0`): one choice each, logprobs asked for (0, or
    the top-k up to `MAX_SCORING_LOGPROBS`, vLLM's default bound)."""
    bound = MAX_SCORING_LOGPROBS
    if request.logprobs is None:
        raise InvalidRequest(f"a scoring request (echo with max_tokens: 0) needs logprobs (0 to {bound})", "logprobs")
    if not 0 <= request.logprobs <= bound:
        raise InvalidRequest(
            f"a scoring request's logprobs must be between 0 and {bound}, got {request.logprobs}", "logprobs"
        )
    if request.n != 1:
        raise InvalidRequest(f"a scoring request (echo with max_tokens: 0) takes n = 1, got {request.n}", "n")
    return _prompt_ids(request.prompt, tokenizer, limits, scoring=True)


def _check_ids(ids: list[int], vocab_size: int, param: str, what: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{what} holds token id {bad}, outside the vocabulary [0, {vocab_size})", param)


def _check_stops(request: CompletionRequest, tokenizer, limits: RequestLimits) -> None:
    strings = request.stop_strings
    if len(strings) > OPENAI_MAX_STOP:
        raise InvalidRequest(f"at most {OPENAI_MAX_STOP} stop strings are supported, got {len(strings)}", "stop")
    ids = request.stop_token_ids or []
    _check_ids(ids, limits.vocab_size, "stop_token_ids", "stop_token_ids")
    if limits.max_stop_sequences is not None and len(strings) + len(ids) > limits.max_stop_sequences:
        raise InvalidRequest(
            f"at most {limits.max_stop_sequences} stop sequences (stop strings and stop_token_ids together) are "
            f"supported, got {len(strings) + len(ids)}",
            "stop_token_ids" if ids else "stop",
        )
    if limits.max_stop_tokens is not None:
        for s in strings:
            n = len(tokenizer(s, add_special_tokens=False)["input_ids"])
            if n > limits.max_stop_tokens:
                raise InvalidRequest(
                    f"stop string {s[:40]!r} is {n} tokens; at most {limits.max_stop_tokens} are supported", "stop"
                )


def _prompt_ids(prompt, tokenizer, limits: RequestLimits, scoring: bool = False) -> list[list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise InvalidRequest("prompt must hold at least one prompt", "prompt")
    if len(prompt) > limits.max_prompts:
        raise InvalidRequest(f"at most {limits.max_prompts} prompts per request, got {len(prompt)}", "prompt")
    out = []
    for i, p in enumerate(prompt):
        what = "prompt" if len(prompt) == 1 else f"prompt {i}"
        ids = tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p)
        if not ids:
            raise InvalidRequest(f"{what} is empty", "prompt")
        _check_ids(ids, limits.vocab_size, "prompt", what)
        if len(ids) > limits.max_seq_len or (len(ids) == limits.max_seq_len and not scoring):
            raise InvalidRequest(
                f"{what} of {len(ids)} tokens exceeds max_seq_len={limits.max_seq_len} (no room to generate)",
                "prompt",
            )
        out.append(ids)
    return out


def seed_key(seed: int, choice: int = 0) -> np.ndarray:
    """The engine's PRNG key data (uint32 [2]) of choice `choice` of a request seeded `seed` (any int64):
    `seed + choice` modulo 2^64, high word first, which is `jax.random.PRNGKey` of a 64-bit seed. Distinct seeds
    give distinct keys, and a seed below 2^32 keeps the key `[0, seed]` it always had."""
    u = (int(seed) + int(choice)) % 2**64
    return np.array([u >> 32, u & 0xFFFFFFFF], dtype=np.uint32)
