"""The tool-call text format policies write and the parser that reads it (the Hermes / Qwen convention).

A policy's output calls tools by containing one or more

    <tool_call>{"name": "calculate", "arguments": {"expression": "12*34"}}</tool_call>

blocks (`arguments` may also be a JSON-encoded string, as in the OpenAI API). `format_tool_call` writes a call in
this format (what warm-start transcripts and the chat route's re-rendering of an assistant message's `tool_calls`
use); `parse_tool_calls` reads every block of a text, well-formed (`ToolCall`) or not (`MalformedToolCall`, with
what is wrong). Multi-turn environments (`marin_rl.envs.tools`) and the chat-completions route
(`marin_rl.inference.chat`) share it, so a policy calls tools the same way whoever runs its loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass
class ToolCall:
    """A well-formed tool call parsed from policy output."""

    name: str
    """Name of the tool to call."""
    arguments: dict[str, Any]
    """Keyword arguments of the call."""


@dataclass
class MalformedToolCall:
    """A `<tool_call>` block that could not be parsed."""

    text: str
    """The offending text (inside the tags, or from the opening tag on if it is unterminated)."""
    error: str
    """What is wrong with it."""


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of a tool call in the format `parse_tool_calls` reads."""
    return f"{TOOL_CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{TOOL_CALL_CLOSE}"


def _parse_call(body: str) -> ToolCall | MalformedToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return MalformedToolCall(body, f"invalid JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict):
        return MalformedToolCall(body, 'expected a JSON object {"name": ..., "arguments": {...}}')
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return MalformedToolCall(body, "missing tool 'name'")
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return MalformedToolCall(body, f"'arguments' is a string but not valid JSON ({e.msg})")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return MalformedToolCall(body, f"'arguments' must be a JSON object, got {type(args).__name__}")
    return ToolCall(name, args)


def tool_call_blocks(text: str) -> list[tuple[int, int, ToolCall | MalformedToolCall]]:
    """Every `<tool_call>...</tool_call>` block of `text` in order, as `(start, end, call)`: the block's character
    span `text[start:end]` (tags included) and what it parses to. An unterminated block runs to the end of `text`
    and ends the list."""
    blocks: list[tuple[int, int, ToolCall | MalformedToolCall]] = []
    pos = 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) >= 0:
        end = text.find(TOOL_CALL_CLOSE, start)
        if end < 0:
            error = f"unterminated {TOOL_CALL_OPEN} (no {TOOL_CALL_CLOSE})"
            blocks.append((start, len(text), MalformedToolCall(text[start:], error)))
            break
        blocks.append((start, end + len(TOOL_CALL_CLOSE), _parse_call(text[start + len(TOOL_CALL_OPEN) : end].strip())))
        pos = end + len(TOOL_CALL_CLOSE)
    return blocks


def parse_tool_calls(text: str) -> list[ToolCall | MalformedToolCall]:
    """Every `<tool_call>...</tool_call>` block of `text`, in order (an unterminated one ends the list)."""
    return [call for _, _, call in tool_call_blocks(text)]
