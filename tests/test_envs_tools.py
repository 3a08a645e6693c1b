"""Tools: schemas from docstrings, per-instance registries, errors returned as tool turns, tool-call parsing, the
Python code tool's limits, and the calculator environment (verifier, safe evaluator, transcripts, episodes)."""

import asyncio
import dataclasses
import time
from fractions import Fraction

import equinox as eqx
import jax
import numpy as np
import pytest

from marin_rl.config import EnvConfig, make_environment
from marin_rl.envs.base import Problem, SamplingParams, run_groups
from marin_rl.envs.calculator import (
    CalculatorEnvironment,
    CalculatorError,
    answer_is_correct,
    calculate,
    evaluate_expression,
    extract_final_number,
)
from marin_rl.envs.code_tools import execute_python, make_run_python, run_python
from marin_rl.envs.tools import (
    MalformedToolCall,
    ToolCall,
    ToolEnvironment,
    format_tool_call,
    function_schema,
    parse_tool_calls,
)
from marin_rl.inference.client import Sample
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.model.build import build_model
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def weather(city: str, days: int = 1, units: str | None = None) -> str:
    """Forecast for a city.

    Returns a short text.

    Args:
        city: Name of the city, e.g. "Paris".
        days: How many days
            ahead to forecast.
        units: 'metric' or 'imperial'.
    """
    return f"{city}: sunny for {days} day(s)"


async def add(a: int, b: int) -> dict:
    """Add two integers.

    Args:
        a: First term.
        b: Second term.
    """
    await asyncio.sleep(0)
    return {"sum": a + b}


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: Numerator.
        b: Denominator.
    """
    return a / b


async def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    await asyncio.sleep(seconds)
    return "rested"


def block(seconds: float) -> str:
    """Block the calling thread.

    Args:
        seconds: How long to block.
    """
    time.sleep(seconds)
    return "done"


class QA(ToolEnvironment):
    """A minimal tool environment for the tests: one problem, tools registered by the caller."""

    name = "qa"

    def train_problems(self):
        return [Problem(id="q", prompt="What is 2+3?", answer="5")]

    def eval_problems(self):
        return self.train_problems()


def test_schema_from_signature_and_docstring():
    assert function_schema(weather) == {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Forecast for a city.\n\nReturns a short text.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": 'Name of the city, e.g. "Paris".'},
                    "days": {"type": "integer", "description": "How many days ahead to forecast."},
                    "units": {"type": "string", "nullable": True, "description": "'metric' or 'imperial'."},
                },
                "required": ["city"],
            },
        },
    }
    assert function_schema(add, name="plus")["function"]["name"] == "plus"

    def undocumented(x: int) -> int:
        """No Args section."""
        return x

    def untyped(x):
        """Untyped.

        Args:
            x: something
        """

    with pytest.raises(ValueError, match="tool 'undocumented'.*no description for the argument 'x'"):
        function_schema(undocumented)
    with pytest.raises(ValueError, match="tool 'untyped'.*missing a type hint"):
        function_schema(untyped)


def test_registries_belong_to_instances(tok):
    class WithWeather(QA):
        def __init__(self, tokenizer, **kwargs):
            super().__init__(tokenizer, **kwargs)
            self.register_tool(weather)

    a, b, sub = QA(tok), QA(tok), WithWeather(tok)
    a.register_tool(add)
    assert a.tool_names == ["add"] and b.tool_names == [] and sub.tool_names == ["weather"]
    assert WithWeather(tok).tool_names == ["weather"]  # a fresh registry every time
    assert QA(tok).tool_names == []
    with pytest.raises(ValueError, match="a tool named 'add' is already registered"):
        a.register_tool(add)
    assert a.list_tools() == [function_schema(add)]
    a.list_tools()[0]["function"]["name"] = "mutated"  # list_tools hands out copies
    assert a.tool_names == ["add"] and a.list_tools()[0]["function"]["name"] == "add"
    # the prompt lists exactly the instance's tools, through the chat template
    text = tok.decode(a.encode_prompt(a.train_problems()[0]))
    assert '"name": "add"' in text and '"name": "weather"' not in text and "<tool_call>" in text
    assert "<tool_call>" not in tok.decode(b.encode_prompt(b.train_problems()[0]))  # no tools, no tool list
    hidden = QA(tok, show_tools=False)
    hidden.register_tool(add)
    assert tok.decode(hidden.encode_prompt(hidden.train_problems()[0])) == "<|user|>What is 2+3?<eos><|assistant|>"


@pytest.mark.exclusive  # the tool timeout's wall-clock bound
def test_aexecute_returns_results_and_errors_as_text(tok):
    env = QA(tok, tool_timeout_s=0.3, max_tool_output_chars=40)
    for fn in (weather, add, divide, nap, block):
        env.register_tool(fn)
    env.register_tool(nap, name="long_nap", timeout_s=2.0)

    async def run():
        calls = [
            ("weather", {"city": "Oslo", "days": 2}),
            ("add", {"a": 2, "b": "3"}),  # lax validation: '3' is an int
            ("divide", {"a": 1, "b": 4}),
            ("nope", {}),
            ("add", {"a": 1}),
            ("add", {"a": 1, "b": 2, "c": 3}),
            ("add", {"a": "x", "b": 2}),
            ("add", [1, 2]),
            ("divide", {"a": 1, "b": 0}),
            ("nap", {"seconds": 5}),
            ("block", {"seconds": 1}),
            ("long_nap", {"seconds": 0.5}),
            ("weather", {"city": "x" * 100}),
        ]
        return await asyncio.gather(*(env.aexecute(name, args) for name, args in calls))

    start = time.time()
    out = asyncio.run(run())
    assert time.time() - start < 4  # the timeouts cut the 5 s nap (the blocked thread ends after 1 s)
    assert out[0] == "Oslo: sunny for 2 day(s)"
    assert out[1] == '{"sum": 5}'
    assert out[2] == "0.25"
    assert out[3] == "error: unknown tool 'nope'; available tools: weather, add, divide, nap, block, long_nap"
    assert out[4] == "error: invalid arguments for add: b: Missing required argument"
    assert out[5] == "error: invalid arguments for add: c: Unexpected keyword argument"
    assert out[6].startswith("error: invalid arguments for add: a: Input should be a valid integer")
    assert out[7] == "error: arguments of add must be an object, got list"
    assert out[8] == "error: divide raised ZeroDivisionError: float division by zero"
    assert out[9] == "error: nap timed out after 0.3 s"
    assert out[10] == "error: block timed out after 0.3 s"
    assert out[11] == "rested"  # its own, longer timeout
    assert out[12] == "x" * 40 + "\n[... 80 more characters cut]"  # 'xxx...x: sunny for 1 day(s)' is 120 long


@pytest.mark.parametrize(
    "text, expected",
    [
        ("no call", []),
        (format_tool_call("add", {"a": 1, "b": 2}), [ToolCall("add", {"a": 1, "b": 2})]),
        (
            '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call> then '
            '<tool_call> {"name": "b"} </tool_call>',
            [ToolCall("a", {"x": 1}), ToolCall("b", {})],
        ),
        ("<tool_call>{name: add}</tool_call>", [MalformedToolCall("{name: add}", "invalid JSON")]),
        ('<tool_call>{"arguments": {}}</tool_call>', [MalformedToolCall('{"arguments": {}}', "missing tool 'name'")]),
        ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', [MalformedToolCall("", "must be a JSON object")]),
        ('<tool_call>["a"]</tool_call>', [MalformedToolCall('["a"]', "expected a JSON object")]),
        ('<tool_call>{"name": "a"', [MalformedToolCall('<tool_call>{"name": "a"', "unterminated <tool_call>")]),
        ("</tool_call> stray", []),
    ],
)
def test_parse_tool_calls(text, expected):
    got = parse_tool_calls(text)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert type(g) is type(e)
        if isinstance(e, ToolCall):
            assert g == e
        else:
            assert e.error in g.error and (not e.text or g.text == e.text)


def _sample(tok, text, closed=True):
    ids = tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if closed else [])
    return Sample(ids, [-0.1] * len(ids), text, "stop" if closed else "length", 0, 0, "local", 0.0)


def test_tool_errors_reach_the_policy_as_tool_turns(tok):
    env = QA(tok, max_tool_calls_per_turn=3)
    env.register_tool(add)
    problem = env.train_problems()[0]
    conv = env.new_conversation(problem)
    text = (
        format_tool_call("add", {"a": 2, "b": 3})
        + format_tool_call("sub", {"a": 1})
        + format_tool_call("add", {"a": "two", "b": 3})
        + format_tool_call("add", {"a": 1, "b": 1})
        + '<tool_call>{"name": "add", "arguments": {"a": 1'
    )
    conv.add_policy_turn(_sample(tok, text, closed=False), SamplingParams(max_tokens=400))
    messages, rewards = asyncio.run(env.env_response(problem, conv))
    assert rewards == {}
    assert [m["content"] for m in messages] == [
        '{"sum": 5}',
        "error: unknown tool 'sub'; available tools: add",
        "error: invalid arguments for add: a: Input should be a valid integer, unable to parse string as an integer",
        "error: at most 3 tool calls per turn; this one was not run",
        "error: malformed tool call: unterminated <tool_call> (no </tool_call>)",
    ]
    turn = conv.add_messages(messages)
    assert turn.role == "tool" and not turn.is_sampled
    # the truncated policy turn is closed by the env turn; each result is a rendered tool message
    expected = "<eos>" + "".join(f"<|tool|>{m['content']}<eos>" for m in messages) + "<|assistant|>"
    assert tok.decode(turn.token_ids) == expected
    conv.add_policy_turn(_sample(tok, "The answer is 5."), SamplingParams(max_tokens=20))
    assert asyncio.run(env.env_response(problem, conv)) == (None, {})  # no tool call: the final answer
    assert env.final_answer(conv) == "The answer is 5."


@pytest.mark.exclusive  # the tool's wall-time limit, measured
def test_code_tool_output_and_limits(tok):
    async def run():
        return await asyncio.gather(
            execute_python("print(6*7)"),
            execute_python("import sys\nprint('out')\nprint('oops', file=sys.stderr)\nsys.exit(3)"),
            execute_python("while True:\n    pass", timeout_s=1.0),
            execute_python("import time\ntime.sleep(30)", timeout_s=0.5),
            execute_python("x = bytearray(3 * 1024**3)\nprint('allocated')", memory_mb=256),
            execute_python("print('x' * 10000)", max_output_chars=50),
            execute_python("import subprocess\nsubprocess.Popen(['sleep', '30'])\nprint('spawned')", timeout_s=20),
        )

    start = time.time()
    out = asyncio.run(run())
    assert time.time() - start < 15  # the spawned sleep does not hold the tool until the 20 s wall-time limit
    assert out[0] == "42"
    assert out[1] == "out\nstderr:\noops\nexit code 3"
    # a busy loop reaches the 1 s CPU-time and wall-time limits together: either may be the one reported
    assert out[2] in ("error: wall-time limit of 1 s exceeded", "error: CPU-time limit of 1 s exceeded")
    assert out[3] == "error: wall-time limit of 0.5 s exceeded"
    assert out[4].startswith("error: memory limit of 256 MB exceeded")
    assert out[5] == "x" * 50 + "\n[... 9951 more characters cut]"
    assert out[6] == "spawned"
    # registered on an environment, with its schema from the docstring
    env = QA(tok)
    env.register_tool(run_python)
    env.register_tool(make_run_python(timeout_s=0.5), name="quick_python")
    assert env.list_tools()[0]["function"]["parameters"]["required"] == ["code"]
    assert asyncio.run(env.aexecute("run_python", {"code": "print(sum(range(10)))"})) == "45"
    assert asyncio.run(env.aexecute("quick_python", {"code": "while True: pass"})).startswith(
        "error: wall-time limit of 0.5 s"
    )


# ---- calculator -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("347*5821", "2019887"),
        ("(12+3)*45", "675"),
        ("2^10", "1024"),
        ("2**-2", "0.25"),
        ("10/4", "2.5"),
        ("1/3", "0.333333333333"),
        ("7//2", "3"),
        ("-7 % 3", "2"),
        ("1,234*2", "2468"),
        ("0.1+0.2", "0.3"),
        ("1/0", "error: division by zero"),
        ("5 % 0", "error: division by zero"),
        ("9**9**9", "error: result too large"),
        ("2**0.5", "error: only integer exponents are supported"),
        (
            "__import__('os').system('true')",
            "error: unsupported syntax (Call); use numbers, + - * / // % ** and parentheses",
        ),
        ("x + 1", "error: unsupported syntax (Name); use numbers, + - * / // % ** and parentheses"),
        ("True + 1", "error: unsupported syntax (Constant); use numbers, + - * / // % ** and parentheses"),
        ("", "error: empty expression"),
        ("1" * 201, "error: expression longer than 200 characters"),
    ],
)
def test_calculator_tool(expression, expected):
    assert calculate(expression) == expected


def test_calculator_exact_and_rejects_syntax():
    assert evaluate_expression("(2**100 + 1) - 2**100") == 1
    assert evaluate_expression("0.1*3") == Fraction(3, 10)
    with pytest.raises(CalculatorError, match="cannot parse"):
        evaluate_expression("1 +* 2")


@pytest.mark.parametrize(
    "final, correct",
    [
        ("2019887", True),
        (" 2019887\n", True),
        ("2,019,887", True),
        ("2019887.0", True),
        ("The answer is 2019887.", True),
        ("about 2019886 or 2019887", True),  # the last number counts
        ("2019887 or 2019888", False),
        ("20198870", False),
        ("-2019887", False),
        ("", False),
        (None, False),
        ("no number", False),
        ("2,019,88", False),
    ],
)
def test_calculator_verifier(final, correct):
    assert answer_is_correct(final, "2019887") is correct


def test_extract_final_number():
    assert extract_final_number("x=-12.5, then 3") == 3
    assert extract_final_number("-12.50") == Fraction(-25, 2)
    assert extract_final_number("1,234,567") == 1234567


def test_calculator_problems_reference_and_scoring(tok):
    env = CalculatorEnvironment(tok, num_train=300, num_eval=20, seed=3)
    again = CalculatorEnvironment(tok, num_train=300, num_eval=20, seed=3)
    assert [p.id for p in env.eval_problems()] == [p.id for p in again.eval_problems()]
    assert {p.id for p in env.train_problems()}.isdisjoint(p.id for p in env.eval_problems())
    assert len(env.train_problems()) == 300 and len(env.eval_problems()) == 20
    for p in env.train_problems()[:50]:
        a, b = p.fields["expression"].split("*")
        assert 100 <= int(a) <= 9999 and 100 <= int(b) <= 9999 and int(p.answer) == int(a) * int(b)
    assert env.tool_names == ["calculate"]

    problem = env.train_problems()[0]
    prompt_ids = env.encode_prompt(problem)
    expr = problem.fields["expression"]
    call = format_tool_call("calculate", {"expression": expr})
    reference = env.reference_completion(problem)
    assert reference == f"{call}<eos><|tool|>{problem.answer}<eos><|assistant|>{problem.answer}"

    # play the reference transcript through the env as if sampled: the tool runs, the answer scores 1
    async def play(final_text):
        conv = env.new_conversation(problem)
        conv.add_policy_turn(_sample(tok, call), SamplingParams(max_tokens=200))
        messages, _ = await env.env_response(problem, conv)
        conv.add_messages(messages)
        conv.add_policy_turn(_sample(tok, final_text), SamplingParams(max_tokens=20))
        assert (await env.env_response(problem, conv)).messages is None
        return conv, await env.episode_rewards(problem, conv)

    conv, rewards = asyncio.run(play(problem.answer))
    assert rewards == {"correct": 1.0, "used_tool": 1.0}
    # the conversation's ids are the prompt followed by the reference completion's tokens (plus EOS), exactly
    completion_ids = tok(reference, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert conv.token_ids == prompt_ids + completion_ids
    assert asyncio.run(play("no idea"))[1] == {"correct": 0.0, "used_tool": 1.0}

    async def no_tool():
        conv = env.new_conversation(problem)
        conv.add_policy_turn(_sample(tok, f"It is {problem.answer}"), SamplingParams(max_tokens=20))
        return await env.episode_rewards(problem, conv)

    assert asyncio.run(no_tool()) == {"correct": 1.0, "used_tool": 0.0}
    with pytest.raises(ValueError, match="operations: must be a string of"):
        CalculatorEnvironment(tok, operations="/")
    with pytest.raises(ValueError, match=r"max_digits: must be >= min_digits \(4\), got 3"):
        CalculatorEnvironment(tok, min_digits=4, max_digits=3)


@pytest.fixture(scope="module")
def server(tok):
    model = build_model(ModelConfig(architecture=dataclasses.replace(tiny_llama(), max_seq_len=512)), len(tok))
    srv = LevanterInferenceServer(
        model,
        tok,
        InferenceConfig(max_seqs=8, max_seq_len=512, levanter=LevanterServerConfig(page_size=16, prefill_tokens=2048)),
    )
    srv.apply_weights(0, [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))])
    address = srv.start()
    yield address
    srv.stop()


def test_calculator_episodes_from_a_run_config(tok, server):
    env = make_environment(
        EnvConfig(
            name="calc",
            env_class="marin_rl.envs.calculator:CalculatorEnvironment",
            args={"num_train": 20, "num_eval": 5, "max_episode_tokens": 512, "max_turns": 2},
        ),
        tok,
        seed=0,
    )
    assert isinstance(env, CalculatorEnvironment) and env.name == "calc"
    problems = env.eval_problems()[:2]
    groups = asyncio.run(run_groups(env, [server], problems, 2, SamplingParams(temperature=1.0, max_tokens=12)))
    for problem, group in zip(problems, groups, strict=True):
        for r in group.rollouts:
            r.validate(len(tok))
            assert r.environment == "calc" and r.problem_id == problem.id
            assert r.turns[0].token_ids == env.encode_prompt(problem)  # tools listed in the prompt
            assert '"name": "calculate"' in tok.decode(r.turns[0].token_ids)
            sampled = [t for t in r.turns if t.is_sampled]
            final = None if "<tool_call>" in sampled[-1].message else sampled[-1].message
            assert sampled[-1].rewards["correct"] == float(answer_is_correct(final, problem.answer))
            assert r.reward == sampled[-1].rewards["correct"]  # used_tool has weight 0
            assert r.loss_mask().sum() == sum(len(t.token_ids) for t in sampled)
