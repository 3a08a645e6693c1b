"""Tools served by an MCP server (Model Context Protocol), through the `mcp` package's client.

`McpConnection` connects to one server, either a command started as a subprocess speaking MCP over stdio
(`command=['python', 'server.py']`) or a streamable-HTTP endpoint (`url='http://host:8000/mcp'`), lists its tools
in the OpenAI tools format and calls them. The client session lives in a background thread with its own event
loop, so one connection serves episodes from any event loop (an env actor's, `asyncio.run` in a script) and is
entered and closed in one task, as the MCP client requires.

`McpToolEnvironment` is a `ToolEnvironment` whose tools are an MCP server's: question/answer problems (inline or
a JSONL/Parquet file, as in the math env), the policy calls the server's tools, and the final answer is checked
with the math verifier (numbers compared exactly, equivalent forms accepted).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import shlex
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from mcp import Client, StdioServerParameters

from marin_rl.bounds import bounded
from marin_rl.envs.base import Problem
from marin_rl.envs.data import BadRows, ProblemSourceArgs, RowError, qa_problems, source_rows, train_eval_split
from marin_rl.envs.math import verify
from marin_rl.envs.multi_turn import Conversation
from marin_rl.envs.tools import Tool, ToolEnvironment


def _result_text(result: Any) -> str:
    """A `CallToolResult` as text: its text blocks (other blocks named), or its structured content."""
    parts = []
    for block in result.content or []:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'unknown')} content]")
    text = "\n".join(parts)
    if not text and result.structured_content is not None:
        text = json.dumps(result.structured_content)
    return f"error: {text}" if result.is_error else text


def _close(loop: asyncio.AbstractEventLoop, stop: asyncio.Event, done: concurrent.futures.Future, thread) -> None:
    if loop.is_closed():
        return
    try:
        loop.call_soon_threadsafe(stop.set)
        done.result(timeout=10)
    except Exception:  # the session failed or is stuck: stop the loop anyway
        pass
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    if not thread.is_alive():
        loop.close()


class McpConnection:
    """One MCP client session, owned by a background thread; `tools` lists the server's tools.

    Give exactly one of `command` (argv, or a shell-style string, of a stdio server) and `url` (streamable HTTP).
    `env` adds environment variables for a stdio server. Raises ConnectionError naming the server if it cannot be
    reached within `connect_timeout_s`. `close()` ends the session (also done at garbage collection and exit).
    """

    def __init__(
        self,
        *,
        command: list[str] | str | None = None,
        url: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        connect_timeout_s: float = 60.0,
    ):
        if (command is None) == (url is None):
            raise ValueError("give exactly one of an MCP server `command` (stdio) and `url` (streamable HTTP)")
        if command is not None:
            argv = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
            if not argv:
                raise ValueError("MCP server command is empty")
            server: Any = StdioServerParameters(command=argv[0], args=argv[1:], env=env, cwd=cwd)
            self.description = f"stdio server {shlex.join(argv)!r}"
        else:
            server = url
            self.description = f"HTTP server {url!r}"
        self._loop = asyncio.new_event_loop()
        stop = asyncio.Event()  # bound to the background loop when first awaited there
        ready: concurrent.futures.Future = concurrent.futures.Future()

        async def serve() -> None:  # holds no reference to `self`, so the connection can be garbage-collected
            try:
                async with Client(server) as client:
                    ready.set_result(client)
                    await stop.wait()
            except BaseException as e:
                if not ready.done():
                    ready.set_exception(e)
                raise

        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-client", daemon=True)
        self._thread.start()
        self._done = asyncio.run_coroutine_threadsafe(serve(), self._loop)
        self._finalizer = weakref.finalize(self, _close, self._loop, stop, self._done, self._thread)
        try:
            self._client: Client = ready.result(timeout=connect_timeout_s)
            self.tools = self._run(self._list_tools(), connect_timeout_s)
        except Exception as e:
            self.close()
            raise ConnectionError(f"cannot connect to MCP {self.description}: {type(e).__name__}: {e}") from e

    def _run(self, coro, timeout: float | None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _list_tools(self) -> list[dict[str, Any]]:
        tools, cursor = [], None
        while True:
            page = await self._client.list_tools(cursor=cursor)
            tools += page.tools
            cursor = page.next_cursor
            if cursor is None:
                break
        return [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.input_schema or {"type": "object", "properties": {}},
                },
            }
            for t in tools
        ]

    async def acall(self, name: str, arguments: dict[str, Any]) -> str:
        """Call a tool from any event loop; its result as text ('error: ...' when the server reports one)."""
        if not self._finalizer.alive:
            raise ConnectionError(f"MCP {self.description} is closed")
        future = asyncio.run_coroutine_threadsafe(self._client.call_tool(name, arguments), self._loop)
        return _result_text(await asyncio.wrap_future(future))

    def close(self) -> None:
        """End the session (a stdio server process is stopped) and the background thread."""
        self._finalizer()


class McpToolEnvironment(ToolEnvironment):
    """Questions answered with the tools of an MCP server; reward 1 for a correct final answer.

    Its arguments (`Args`) add the MCP server's and the problems' to `ToolEnvironment`'s.
    """

    name = "mcp"

    @dataclass
    class Args(ToolEnvironment.Args, ProblemSourceArgs):
        mcp_command: list[str] | str | None = None
        """Argv (or a shell-style string) of a stdio MCP server to start, e.g. ['python', 'server.py']."""
        mcp_url: str | None = None
        """URL of a streamable-HTTP MCP server, e.g. 'http://localhost:8000/mcp' (instead of `mcp_command`)."""
        mcp_env: dict[str, str] | None = None
        """Extra environment variables for the stdio server."""
        tools: list[str] | None = None
        """Names of the server's tools to offer (None: all)."""
        prompt_template: str = "{question}"
        """Filled with `{question}` (and any other field of the row)."""
        connect_timeout_s: float = bounded(60.0, gt=0)
        """Seconds to wait for the MCP server to answer."""
        skip_bad_rows: bool = False
        """Leave out (and count, `data_report`) malformed rows instead of refusing the data."""

    args: Args

    def __init__(self, tokenizer, **args):
        super().__init__(tokenizer, **args)
        a = self.args
        self.bad_rows = BadRows(skip=bool(a.skip_bad_rows))
        fields = dict(question_field=a.question_field, answer_field=a.answer_field, prompt_template=a.prompt_template)

        def load(source_path: str | None, inline: list[dict] | None, what: str) -> list[Problem]:
            rows = source_rows(
                source_path, inline, what, path_arg=what.replace("problems", "path"), bad_rows=self.bad_rows
            )
            return qa_problems(rows, source_path or what, bad_rows=self.bad_rows, **fields)

        held_out = (
            None
            if a.eval_problems is None and a.eval_path is None
            else load(a.eval_path, a.eval_problems, "eval_problems")
        )
        self._train, self._eval = train_eval_split(
            load(a.path, a.problems, "problems"), held_out, a.eval_fraction, self.seed, self.name, self.name
        )

        self.connection = McpConnection(
            command=a.mcp_command, url=a.mcp_url, env=a.mcp_env, connect_timeout_s=a.connect_timeout_s
        )
        offered = {t["function"]["name"]: t for t in self.connection.tools}
        tools = a.tools
        if tools is not None:
            missing = sorted(set(tools) - set(offered))
            if missing:
                self.connection.close()
                raise ValueError(
                    f"{self.name}: `tools` names {missing}, not served by MCP "
                    f"{self.connection.description} (it has {sorted(offered)})"
                )
            offered = {k: v for k, v in offered.items() if k in tools}
        for tool_name, schema in offered.items():
            self.add_tool(Tool(name=tool_name, schema=schema, call=self._caller(tool_name)))

    def _caller(self, tool_name: str):
        async def call(arguments: dict[str, Any]) -> str:
            return await self.connection.acall(tool_name, arguments)

        return call

    def train_problems(self) -> list[Problem]:
        return self._train

    def data_report(self) -> dict[str, int]:
        """The problem counts and the malformed rows `skip_bad_rows` left out."""
        return {**super().data_report(), "skipped_malformed_rows": self.bad_rows.counts[RowError.kind]}

    def eval_problems(self) -> list[Problem]:
        return self._eval

    async def episode_rewards(self, problem: Problem, conversation: Conversation) -> dict[str, float]:
        """'correct': the math verifier on the final answer (0 if the episode ended on a tool call)."""
        answer = self.final_answer(conversation)
        return {"correct": verify(answer, problem.answer) if answer is not None else 0.0}

    def close(self) -> None:
        """Close the MCP connection."""
        self.connection.close()
