"""MCP tools: a small MCP server started by the test (stdio and streamable HTTP), listed in the OpenAI tools format
and called through `McpToolEnvironment.aexecute` and tool-call episodes' environment turns."""

import asyncio
import socket
import subprocess
import sys
import time

import pytest

from marin_rl.envs.base import SamplingParams
from marin_rl.envs.mcp_env import McpConnection, McpToolEnvironment
from marin_rl.envs.tools import format_tool_call
from marin_rl.inference.client import Sample
from marin_rl.tokenizer import build_char_tokenizer

SERVER = '''
import asyncio
import logging
import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("arith")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


@server.tool()
def fail(reason: str) -> str:
    """Always raises."""
    raise ValueError(reason)


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return "awake"


if __name__ == "__main__":
    logging.disable(logging.CRITICAL)  # the server logs tool failures with rendered tracebacks on stderr
    if len(sys.argv) > 1:
        server.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
    else:
        server.run()
'''

PROBLEMS = [{"question": "What is 2+3?", "answer": 5}, {"question": "What is 4+4?", "answer": 8}]


@pytest.fixture(scope="module")
def server_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("mcp") / "arith_server.py"
    path.write_text(SERVER)
    return str(path)


@pytest.fixture(scope="module")
def env(server_script):
    tok = build_char_tokenizer()
    env = McpToolEnvironment(
        tok,
        mcp_command=[sys.executable, server_script],
        problems=PROBLEMS,
        eval_fraction=0.5,
        tool_timeout_s=3.0,
    )
    yield env
    env.close()


def test_lists_server_tools_in_openai_format(env):
    tools = {t["function"]["name"]: t for t in env.list_tools()}
    assert sorted(tools) == ["add", "fail", "shout", "slow"]
    add = tools["add"]
    assert add["type"] == "function" and add["function"]["description"] == "Add two integers."
    params = add["function"]["parameters"]
    assert params["type"] == "object" and params["required"] == ["a", "b"]
    assert {k: v["type"] for k, v in params["properties"].items()} == {"a": "integer", "b": "integer"}
    text = env.tokenizer.decode(env.encode_prompt(env.train_problems()[0]))
    assert '"name": "shout"' in text and text.endswith("<eos><|assistant|>")


@pytest.mark.exclusive  # the call timeout's wall-clock bound
def test_calls_go_to_the_server_and_errors_come_back_as_text(env):
    async def run():
        return await asyncio.gather(
            env.aexecute("add", {"a": 2, "b": 40}),
            env.aexecute("shout", {"text": "hi"}),
            env.aexecute("add", {"a": "x", "b": 1}),
            env.aexecute("fail", {"reason": "no"}),
            env.aexecute("slow", {"seconds": 30}),
            env.aexecute("missing", {}),
        )

    start = time.time()
    out = asyncio.run(run())
    assert time.time() - start < 10
    assert out[0] == "42" and out[1] == "HI"
    assert out[2].startswith("error: ") and "valid integer" in out[2]
    assert out[3].startswith("error: ") and "fail" in out[3]
    assert out[4] == "error: slow timed out after 3 s"
    assert out[5] == "error: unknown tool 'missing'; available tools: add, shout, fail, slow"
    # the connection serves calls from another event loop too
    assert asyncio.run(env.aexecute("add", {"a": 1, "b": 1})) == "2"


def test_tool_call_turn_and_final_answer_reward(env):
    tok = env.tokenizer
    problem = next(p for p in env.train_problems() + env.eval_problems() if p.answer == "5")

    def sample(text):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return Sample(ids, [-0.1] * len(ids), text, "stop", 0, 0, "local", 0.0)

    async def play():
        conv = env.new_conversation(problem)
        conv.add_policy_turn(sample(format_tool_call("add", {"a": 2, "b": 3})), SamplingParams(max_tokens=100))
        messages, _ = await env.env_response(problem, conv)
        turn = conv.add_messages(messages)
        conv.add_policy_turn(sample("The answer is 5."), SamplingParams(max_tokens=100))
        return turn, await env.env_response(problem, conv), await env.episode_rewards(problem, conv)

    turn, done, rewards = asyncio.run(play())
    assert tok.decode(turn.token_ids) == "<|tool|>5<eos><|assistant|>" and turn.role == "tool"
    assert done.messages is None and rewards == {"correct": 1.0}


def test_tool_allowlist_and_connection_errors(server_script):
    tok = build_char_tokenizer()
    env = McpToolEnvironment(tok, mcp_command=f"{sys.executable} {server_script}", tools=["add"], problems=PROBLEMS)
    try:
        assert env.tool_names == ["add"]
    finally:
        env.close()
    with pytest.raises(ValueError, match=r"`tools` names \['nope'\], not served by MCP"):
        McpToolEnvironment(tok, mcp_command=[sys.executable, server_script], tools=["nope"], problems=PROBLEMS)
    with pytest.raises(ConnectionError, match="cannot connect to MCP stdio server"):
        McpConnection(command=[sys.executable, "-c", "import sys; sys.exit(1)"], connect_timeout_s=20)
    with pytest.raises(ValueError, match="exactly one of an MCP server `command`"):
        McpConnection()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_streamable_http_server(server_script):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, server_script, str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    pytest.fail("MCP HTTP server did not start")
                time.sleep(0.1)
        conn = McpConnection(url=f"http://127.0.0.1:{port}/mcp")
        try:
            assert sorted(t["function"]["name"] for t in conn.tools) == ["add", "fail", "shout", "slow"]
            assert asyncio.run(conn.acall("add", {"a": 20, "b": 22})) == "42"
        finally:
            conn.close()
        with pytest.raises(ConnectionError, match="MCP HTTP server .* is closed"):
            asyncio.run(conn.acall("add", {"a": 1, "b": 1}))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
