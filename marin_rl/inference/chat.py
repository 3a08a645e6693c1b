"""OpenAI chat completions on top of the completions backends: the request, its rendering, and the response.

`POST /v1/chat/completions` (served by `openai_api.openai_app`, so by the embedded engine and the vLLM front end
alike) takes OpenAI's chat request and answers OpenAI's `chat.completion` object:

* `messages` (roles system, developer — rendered as system —, user, assistant, tool; content a string or a list of
  text parts) and `tools` (function schemas) are rendered by the run tokenizer's chat template with the generation
  prompt, and the ids it gives are the prompt the backend samples from. An assistant message's `tool_calls` are
  passed to templates that render them (those whose source mentions `tool_calls`); for the others (the character
  tokenizer's) they are written after its content in the policy's own tool-call format
  (`marin_rl.tool_calls.format_tool_call`), the text the policy samples when it calls a tool.
* Sampling: `n`, `temperature`, `top_p`, `max_completion_tokens` (or the older `max_tokens`; default: the room left
  in the context), `stop`, `seed`; the template's end-of-turn tokens (EOS, and e.g. `<|im_end|>`) always stop a
  choice. `logprobs: true` returns each sampled token's logprob (`top_logprobs` above 0 is refused: the engines
  return only the sampled token's).
* With `tools` (and `tool_choice` absent, "auto" or "none"), well-formed `<tool_call>` blocks of a choice become its
  `message.tool_calls` (arguments JSON-encoded, ids `call_...`), the rest of the text its `content` (null when
  nothing is left) and the finish reason "tool_calls"; a malformed block stays in `content` as text, so the agent
  sees what the policy wrote. "required" and a named function cannot be enforced by these engines and are refused.
* Beside OpenAI's fields each choice carries `policy_version_start`, `policy_version_end` and
  `policy_version_spans` as in the completions dialect, and, with `return_token_ids: true` (vLLM's extension),
  `token_ids`; the response then has `prompt_token_ids`.
* Refused, as in the completions dialect, with OpenAI's error shape naming the field: `stream: true`, penalties,
  `logit_bias`, a `response_format` other than text, malformed messages (`messages[2].role`), tool-call arguments
  that are not a JSON object, a conversation the template cannot render, a prompt longer than the context.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from marin_rl.inference.completion_request import (
    SERVED_MODEL_NAME,
    CompletionRequest,
    InvalidRequest,
    RequestLimits,
    check_request,
    openai_answer,
    parse_body,
)
from marin_rl.tool_calls import ToolCall, format_tool_call, tool_call_blocks

_STRICT = ConfigDict(strict=True)


class TextPart(BaseModel):
    """A text part of a message's content."""

    model_config = _STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    """The function an assistant message's tool call names, with its JSON-encoded arguments."""

    model_config = _STRICT
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    """One tool call of an assistant message (as a previous response returned it)."""

    model_config = _STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message of the conversation."""

    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined; none: empty)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionSpec(BaseModel):
    """A function the model may call."""

    model_config = _STRICT
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    """A tool of the request (OpenAI's tools format)."""

    model_config = _STRICT
    type: Literal["function"]
    function: FunctionSpec


class ChatRequest(BaseModel):
    """OpenAI's chat-completions request (the fields this server reads; unknown fields are ignored, as vLLM does)."""

    model_config = _STRICT

    model: str = SERVED_MODEL_NAME
    messages: list[ChatMessage]
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    return_token_ids: bool = False
    stream: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None

    @property
    def tools_enabled(self) -> bool:
        """Whether tool calls are parsed from the choices (tools given, `tool_choice` not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def limit_field(self) -> str:
        """The field that sets the completion's token limit (for error messages)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


def parse_chat_request(body: bytes | str) -> ChatRequest:
    """The chat request in a JSON `body`; raises `InvalidRequest` naming the first field (its path, e.g.
    `messages[1].role`) whose value has the wrong type or is missing."""
    return parse_body(ChatRequest, body, _path_refusal)


def _path_refusal(error: dict[str, Any]) -> InvalidRequest:
    param = _path([x for x in error["loc"] if not (isinstance(x, str) and x in _UNION_TAGS)])
    return InvalidRequest(f"{param}: {error['msg']}", param)


_UNION_TAGS = {"str", "list[TextPart]", "list[str]", "dict[str,any]", "dict[str,str]"}


def _path(loc: list) -> str:
    out = ""
    for x in loc:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out


UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "stream": (None, False),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}
"""Chat fields this server does not implement, with the values that ask for what it does anyway."""


def template_messages(messages: list[ChatMessage], tokenizer) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (module docstring): developer as system, content as one string,
    an assistant's tool calls structured for templates that render `tool_calls` and written in the policy's format
    after the content for the others. Raises `InvalidRequest` naming a tool call whose arguments are not a JSON
    object."""
    structured = "tool_calls" in str(getattr(tokenizer, "chat_template", "") or "")
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                param = f"messages[{i}].tool_calls[{j}].function.arguments"
                try:
                    args = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
                except json.JSONDecodeError as e:
                    raise InvalidRequest(f"{param}: not valid JSON ({e.msg})", param) from None
                if not isinstance(args, dict):
                    raise InvalidRequest(f"{param}: must encode a JSON object", param)
                calls.append((call, args))
            if structured:
                msg["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": a}}
                    for c, a in calls
                ]
            else:
                msg["content"] += "".join(format_tool_call(c.function.name, a) for c, a in calls)
        out.append(msg)
    return out


def render_prompt(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """Token ids of `messages` (template form) rendered by the tokenizer's chat template with `tools` and the
    generation prompt. Raises `InvalidRequest` (param `messages`) when the template refuses the conversation."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequest("this server's tokenizer has no chat template; use /v1/completions", "messages")
    try:
        ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # jinja raises TemplateError (e.g. roles that do not alternate) and others
        raise InvalidRequest(f"messages: the chat template cannot render them: {e}", "messages") from None
    if hasattr(ids, "keys") and "input_ids" in ids:  # some versions return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


_MARK = "MARINRLCHATMARK9Q2"


def end_of_turn_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn: EOS, and the first token the template writes after an assistant
    message's content when that is a special token (e.g. `<|im_end|>`, `<|eot_id|>`)."""
    stops = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    if getattr(tokenizer, "chat_template", None) is None:
        return stops
    anchor = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}]
    text = tokenizer.apply_chat_template(anchor, add_generation_prompt=False, tokenize=False)
    at = text.find(_MARK)
    if at >= 0:
        close = tokenizer(text[at + len(_MARK) :], add_special_tokens=False)["input_ids"]
        if close and close[0] in set(tokenizer.all_special_ids) and close[0] not in stops:
            stops.append(int(close[0]))
    return stops


def check_chat_request(
    request: ChatRequest, tokenizer, limits: RequestLimits, stop_token_ids: list[int]
) -> tuple[CompletionRequest, list[int]]:
    """The completions request that samples `request`'s choices and its prompt ids, once every field is within
    `limits` (the completions dialect's checks, `check_request`, with the chat field names); raises `InvalidRequest`
    naming the first field that is not."""
    for name, defaults in UNSUPPORTED.items():
        if getattr(request, name) not in defaults:
            raise InvalidRequest(f"{name} is not supported by this server", name)
    if request.response_format is not None and request.response_format.get("type") != "text":
        raise InvalidRequest("response_format: only {'type': 'text'} is supported by this server", "response_format")
    if request.top_logprobs not in (None, 0):
        raise InvalidRequest("top_logprobs is not supported by this server (only the sampled token's)", "top_logprobs")
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
    if not request.messages:
        raise InvalidRequest("messages must hold at least one message", "messages")
    if request.tool_choice is not None:
        if not request.tools:
            raise InvalidRequest("tool_choice is only allowed when tools are specified", "tool_choice")
        if request.tool_choice not in ("auto", "none"):
            raise InvalidRequest(
                "tool_choice: only 'auto' and 'none' are supported (this server cannot force a tool call)",
                "tool_choice",
            )
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    prompt = render_prompt(tokenizer, template_messages(request.messages, tokenizer), tools)
    limit = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    completion = CompletionRequest(
        model=request.model,
        prompt=prompt,
        max_tokens=limits.max_seq_len - 1 if limit is None else limit,
        temperature=request.temperature,
        n=request.n,
        stop=request.stop,
        stop_token_ids=list(stop_token_ids),
        logprobs=0,
        seed=request.seed,
        top_p=request.top_p,
        return_token_ids=True,
    )
    try:
        [ids] = check_request(completion, tokenizer, limits)
    except InvalidRequest as e:
        param = {"prompt": "messages", "max_tokens": request.limit_field}.get(e.param or "", e.param)
        message = e.message.replace("max_tokens", request.limit_field) if param == request.limit_field else e.message
        raise InvalidRequest(message, param, e.status, e.code) from None
    return completion, ids


def chat_message(text: str, tools_enabled: bool) -> tuple[dict[str, Any], bool]:
    """The assistant message of a sampled `text` and whether it calls tools: with tools enabled, the well-formed
    tool-call blocks become `tool_calls` and the rest of the text `content` (null when nothing is left)."""
    calls = []
    content = text
    if tools_enabled:
        kept, pos = [], 0
        for start, end, call in tool_call_blocks(text):
            if isinstance(call, ToolCall):
                kept.append(text[pos:start])
                pos = end
                calls.append(
                    {
                        "id": f"call_{uuid.uuid4().hex[:24]}",
                        "type": "function",
                        "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
                    }
                )
        content = "".join(kept) + text[pos:]
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else ""), "refusal": None}
    if calls:
        message["tool_calls"] = calls
    return message, bool(calls)


def logprobs_content(tokenizer, token_ids: list[int], logprobs: list[float]) -> dict[str, Any]:
    """OpenAI's `choice.logprobs` of the sampled tokens (no alternatives: `top_logprobs` is empty)."""
    tokens = tokenizer.convert_ids_to_tokens(token_ids)
    return {
        "content": [
            {"token": t, "logprob": float(lp), "bytes": list(t.encode("utf-8")), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs, strict=True)
        ],
        "refusal": None,
    }


def chat_response(
    request: ChatRequest, created: float, prompt: list[int], choices: list[dict[str, Any]], completion_tokens: int
) -> dict[str, Any]:
    """The `chat.completion` body of `choices` with token usage (and `prompt_token_ids` with `return_token_ids`)."""
    prompt_tokens = len(prompt) * request.n
    chat_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    body = openai_answer("chat.completion", chat_id, request.model, created, choices, prompt_tokens, completion_tokens)
    if request.return_token_ids:
        body["prompt_token_ids"] = list(prompt)
    return body


TEMPERATURE_HEADER = "x-sampling-temperature"
"""A header that sets the request's temperature (an environment's sampling, whatever its agent asks for)."""
MAX_TOKENS_HEADER = "x-sampling-max-tokens"
"""A header that caps the request's completion tokens (an environment's `max_tokens` per turn)."""


def apply_sampling_headers(request: ChatRequest, headers) -> ChatRequest:
    """`request` with the sampling the headers impose: `X-Sampling-Temperature` replaces its temperature,
    `X-Sampling-Max-Tokens` caps its token limit (sets it when it has none). Raises `InvalidRequest` naming a header
    that is not a number."""
    update: dict[str, Any] = {}
    for header, kind in ((TEMPERATURE_HEADER, float), (MAX_TOKENS_HEADER, int)):
        value = headers.get(header)
        if value is None:
            continue
        try:
            update[header] = kind(value)
        except ValueError:
            raise InvalidRequest(f"header {header}: expected a number, got {value!r}", header) from None
    if not update:
        return request
    changes: dict[str, Any] = {}
    if TEMPERATURE_HEADER in update:
        changes["temperature"] = update[TEMPERATURE_HEADER]
    if MAX_TOKENS_HEADER in update:
        cap = update[MAX_TOKENS_HEADER]
        field = request.limit_field
        current = getattr(request, field)
        changes[field] = cap if current is None else min(current, cap)
    return request.model_copy(update=changes)
