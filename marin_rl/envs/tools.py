"""Tool use: tools registered on an environment instance, called by the policy from its output text.

Tool-call format (the Hermes / Qwen convention): a policy turn calls tools by containing one or more

    <tool_call>{"name": "calculate", "arguments": {"expression": "12*34"}}</tool_call>

blocks (`arguments` may also be a JSON-encoded string, as in the OpenAI API). Each call's result comes back as a
message of role 'tool' (all results of one turn form one environment turn). A turn without tool calls ends the
episode: it is the final answer. A malformed call (unterminated tag, invalid JSON, no name, arguments that are not
an object) is answered with an error message instead of a result, so the policy sees what went wrong.

Tool schemas are generated from a function's signature and Google-style docstring (`transformers.utils.
get_json_schema`: parameter types from annotations, descriptions from the `Args:` section; every parameter needs
both) in the OpenAI tools format, and are rendered into the prompt by the chat template (`tools=`). Arguments are
validated against the signature with pydantic before a call. Every failure (unknown tool, bad or missing arguments,
an exception, a timeout) is returned to the policy as text starting with 'error:'; nothing a tool does ends the
episode or the actor.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pydantic
from transformers.utils import get_json_schema

from marin_rl.bounds import bounded
from marin_rl.envs.base import Problem
from marin_rl.envs.multi_turn import Conversation, EnvResponse, MultiTurnEnvironment
from marin_rl.tool_calls import (  # noqa: F401 - the format's names, re-exported for environments
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    MalformedToolCall,
    ToolCall,
    format_tool_call,
    parse_tool_calls,
)


def function_schema(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The OpenAI tools-format schema of a function, from its signature and Google-style docstring.

    Raises ValueError naming the function if a parameter lacks a type annotation or an `Args:` description.
    """
    label = name or getattr(fn, "__name__", repr(fn))
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # transformers raises TypeHintParsingException / DocstringParsingException
        raise ValueError(f"tool {label!r}: cannot build a JSON schema from its signature and docstring: {e}") from e
    function = {k: v for k, v in schema["function"].items() if k != "return"}
    if name is not None:
        function["name"] = name
    return {"type": "function", "function": function}


@dataclass
class Tool:
    """A callable tool: its schema and an async function of the arguments dict."""

    name: str
    """Name the policy calls it by."""
    schema: dict[str, Any]
    """OpenAI tools-format schema ({'type': 'function', 'function': {...}})."""
    call: Callable[[dict[str, Any]], Awaitable[Any]]
    """Runs the tool on the arguments; raises on failure (the environment turns that into text)."""
    timeout_s: float | None = None
    """Wall-time limit of one call (None: the environment's `tool_timeout_s`)."""


def tool_from_function(fn: Callable[..., Any], name: str | None = None, timeout_s: float | None = None) -> Tool:
    """A `Tool` from a sync or async function (arguments validated against its signature with pydantic).

    Sync functions run in a worker thread, so a slow one does not block other episodes; on a timeout the episode
    goes on but the thread finishes in the background (tools that can hang should enforce their own limits, as
    `marin_rl.envs.code_tools.run_python` does).
    """
    schema = function_schema(fn, name)
    validated = pydantic.validate_call(fn)
    is_async = inspect.iscoroutinefunction(fn)  # other callables run in a thread (and are awaited if need be)

    async def call(arguments: dict[str, Any]) -> Any:
        if is_async:
            return await validated(**arguments)
        result = await asyncio.to_thread(validated, **arguments)
        return await result if inspect.isawaitable(result) else result

    return Tool(name=schema["function"]["name"], schema=schema, call=call, timeout_s=timeout_s)


def _format_validation_error(e: pydantic.ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ())) or "arguments"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


def _result_text(result: Any) -> str:
    if result is None:
        return ""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)


class ToolEnvironment(MultiTurnEnvironment):
    """A multi-turn environment whose policy calls tools; subclasses add problems, tools and `episode_rewards`.

    Tools belong to the instance: `self.register_tool(fn)` (typically in `__init__`) adds one to this
    environment's own registry, so two environments, or a subclass and its base, never share tools. Tools are
    listed in the prompt (`show_tools`), called from `<tool_call>` blocks (see the module docstring), and their
    results come back as 'tool' turns. A policy turn without tool calls ends the episode; `final_answer` gives its
    text to `episode_rewards`.

    Its arguments (`Args`) add the tool limits and `show_tools` to `MultiTurnEnvironment`'s.
    """

    @dataclass
    class Args(MultiTurnEnvironment.Args):
        tool_timeout_s: float = bounded(30.0, gt=0)
        """Wall-time limit of a tool call (seconds) unless the tool sets its own."""
        max_tool_calls_per_turn: int = bounded(4, ge=1)
        """Calls beyond this many in one turn are answered with an error."""
        max_tool_output_chars: int = bounded(2000, ge=1)
        """Longer tool results are cut to this many characters (with a note)."""
        show_tools: bool = True
        """Render the tool schemas into the prompt through the chat template's `tools`."""

    args: Args

    def __init__(self, tokenizer, **args):
        super().__init__(tokenizer, **args)
        self.tool_timeout_s = float(self.args.tool_timeout_s)
        self.max_tool_calls_per_turn = self.args.max_tool_calls_per_turn
        self.max_tool_output_chars = self.args.max_tool_output_chars
        self.show_tools = self.args.show_tools
        self._tools: dict[str, Tool] = {}

    # ---- registry ---------------------------------------------------------------------------------------
    def register_tool(self, fn: Callable[..., Any], name: str | None = None, *, timeout_s: float | None = None) -> Tool:
        """Add a sync or async function as a tool of this instance (schema from its signature and docstring)."""
        return self.add_tool(tool_from_function(fn, name, timeout_s))

    def add_tool(self, tool: Tool) -> Tool:
        """Add a prebuilt `Tool` (e.g. one served over MCP); names must be unique within the environment."""
        if tool.name in self._tools:
            raise ValueError(f"{self.name}: a tool named {tool.name!r} is already registered")
        self._tools[tool.name] = tool
        return tool

    @property
    def tool_names(self) -> list[str]:
        """Names of this environment's tools, in registration order."""
        return list(self._tools)

    def list_tools(self) -> list[dict[str, Any]]:
        """Schemas of this environment's tools in the OpenAI tools format (copies)."""
        return [copy.deepcopy(t.schema) for t in self._tools.values()]

    def tools_for_prompt(self) -> list[dict] | None:
        """The tool schemas for the chat template, if `show_tools` and there are any."""
        return self.list_tools() if self.show_tools and self._tools else None

    # ---- execution --------------------------------------------------------------------------------------
    async def aexecute(self, name: str, arguments: dict[str, Any]) -> str:
        """Run tool `name` on `arguments`; the result, or the error, as text for the policy (never raises)."""
        tool = self._tools.get(name)
        if tool is None:
            available = ", ".join(self._tools) or "none"
            return f"error: unknown tool {name!r}; available tools: {available}"
        if not isinstance(arguments, dict):
            return f"error: arguments of {name} must be an object, got {type(arguments).__name__}"
        timeout = tool.timeout_s if tool.timeout_s is not None else self.tool_timeout_s
        try:
            result = await asyncio.wait_for(tool.call(arguments), timeout)
        except pydantic.ValidationError as e:
            return f"error: invalid arguments for {name}: {_format_validation_error(e)}"
        except TimeoutError:
            return f"error: {name} timed out after {timeout:g} s"
        except Exception as e:
            return f"error: {name} raised {type(e).__name__}: {e}"
        text = _result_text(result)
        if len(text) > self.max_tool_output_chars:
            cut = len(text) - self.max_tool_output_chars
            text = text[: self.max_tool_output_chars] + f"\n[... {cut} more characters cut]"
        return text

    async def env_response(self, problem: Problem, conversation: Conversation) -> EnvResponse:
        """Run the tool calls of the last policy turn and return their results as 'tool' messages; a turn
        without tool calls ends the episode."""
        calls = parse_tool_calls(conversation.last_policy_turn.message)
        if not calls:
            return EnvResponse(None, {})

        async def answer(i: int, call: ToolCall | MalformedToolCall) -> dict[str, str]:
            if isinstance(call, MalformedToolCall):
                return {"role": "tool", "content": f"error: malformed tool call: {call.error}"}
            if i >= self.max_tool_calls_per_turn:
                content = f"error: at most {self.max_tool_calls_per_turn} tool calls per turn; this one was not run"
                return {"role": "tool", "name": call.name, "content": content}
            return {"role": "tool", "name": call.name, "content": await self.aexecute(call.name, call.arguments)}

        messages = await asyncio.gather(*(answer(i, c) for i, c in enumerate(calls)))
        return EnvResponse(list(messages), {})

    @staticmethod
    def final_answer(conversation: Conversation) -> str | None:
        """The last policy turn's text if it is a final answer (no tool call in it), else None."""
        last = conversation.last_policy_turn
        if last is None or TOOL_CALL_OPEN in last.message:
            return None
        return last.message
