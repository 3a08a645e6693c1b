"""An agent written only against the `openai` SDK: it solves arithmetic with a calculator tool, in its own loop.

Nothing here knows marin_rl: point `solve` at any OpenAI-compatible chat endpoint and it runs. marin_rl trains it
through `marin_rl.envs.agent:AgentEnvironment` (see experiments/openai_agent.yaml), which gives it a client bound to
the policy server's capturing chat route and scores what it returns.

    python -m marin_rl.run --config experiments/openai_agent.yaml
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator

MODEL = "policy"
MAX_TURNS = 3
DEMO_ERROR_RATE = 0.4
"""The fraction of tasks whose demonstration answers wrongly (the calculator's result slipped by ±1 or ±10)."""
TOOLS = [
    {
        "type": "function",
        "function": {"name": "calc", "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}},
    }
]
"""One tool with a short schema: the character-level policy reads it in every prompt."""

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calc(e: str) -> str:
    """The value of an integer expression of + - * and parentheses, or an error message."""

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("use integers, + - * and parentheses")

    try:
        return str(value(ast.parse(str(e)[:100], mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as err:
        return f"error: {err}"


async def solve(client, task: dict) -> str:
    """Ask the model, run the calculator calls it makes, and return its final answer (the text of its first reply
    without a tool call; empty when it never gives one)."""
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            try:
                result = calc(json.loads(call.function.arguments).get("e", ""))
            except (json.JSONDecodeError, AttributeError):
                result = "error: arguments must be a JSON object"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def demonstration(task: dict) -> dict:
    """An episode of `task` as this agent would send it (for a supervised warm start): call the calculator on the
    expression, then answer with its result. An unreliable demonstrator: for a fixed `DEMO_ERROR_RATE` of the tasks
    (chosen by a hash of the expression) the answer slips by ±1 or ±10 from the tool's result, so the warm-started
    agent uses the tool but copies its result unreliably, and reinforcement on the exact answer has something to fix."""
    expression = task["expression"]
    arguments = json.dumps({"e": expression})
    call = {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": arguments}}
    result = calc(expression)
    answer = result
    digest = int.from_bytes(hashlib.sha256(expression.encode()).digest()[:8], "big")
    if digest % 1000 < DEMO_ERROR_RATE * 1000 and not result.startswith("error"):
        answer = str(int(result) + (-10, -1, 1, 10)[(digest // 1000) % 4])
    return {
        "messages": [
            {"role": "user", "content": task["prompt"]},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": result},
            {"role": "assistant", "content": answer},
        ],
        "tools": TOOLS,
    }
