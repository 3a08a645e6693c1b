"""A tool-use task: arithmetic too large to do in the head, with a `calculate` tool, rewarded for the exact answer.

An episode: the prompt asks for e.g. 347*5821; the policy calls
`<tool_call>{"name": "calculate", "arguments": {"expression": "347*5821"}}</tool_call>`, gets '2019887' back as a
tool turn, and answers. The last number of the final answer (a turn without a tool call) is compared with the
exact result: '2,019,887', '2019887.0' and 'The answer is 2019887.' are all correct.

    python -m marin_rl.try_env calculator --config experiments/calculator.yaml
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re
from dataclasses import dataclass
from fractions import Fraction

from marin_rl.bounds import bounded
from marin_rl.envs.base import Problem
from marin_rl.envs.multi_turn import Conversation
from marin_rl.envs.tools import ToolEnvironment, format_tool_call

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = Fraction(10) ** 100
DEFAULT_PROMPT_TEMPLATE = "What is {expression}? Use the calculate tool, then reply with the number only."
OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate (the message says why)."""


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only integer exponents are supported")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    if base not in (0, 1, -1) and abs(exponent) * math.log10(max(abs(base), 1 / abs(base))) > 100:
        raise CalculatorError("result too large")
    return base ** int(exponent)


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            value = _power(left, right)
        elif type(node.op) in _BINARY:
            if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
                raise CalculatorError("division by zero")
            value = _BINARY[type(node.op)](left, right)
        else:
            raise CalculatorError(f"unsupported operator {type(node.op).__name__}")
        if abs(value) > MAX_MAGNITUDE:
            raise CalculatorError("result too large")
        return Fraction(value)
    raise CalculatorError(f"unsupported syntax ({type(node).__name__}); use numbers, + - * / // % ** and parentheses")


def evaluate_expression(expression: str) -> Fraction:
    """The exact value of an arithmetic expression: numbers, + - * / // % ** (or ^) and parentheses.

    Parsed with `ast` and evaluated node by node on exact fractions; nothing is passed to `eval`. Raises
    `CalculatorError` for anything else, division by zero, or results beyond 1e100.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("empty expression")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", expression).replace("^", "**").replace("×", "*")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"cannot parse {expression!r}: {e.msg}") from e
    return _evaluate(tree.body)


def format_number(value: Fraction) -> str:
    """An integer as its digits; other values as a decimal with up to 12 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return format(float(value), ".12g")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, for example "(12+3)*45".
    """
    try:
        return format_number(evaluate_expression(expression))
    except CalculatorError as e:
        return f"error: {e}"


_FINAL_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def extract_final_number(text: str | None) -> Fraction | None:
    """The last number in `text` ('2,019,887' and '2019887.0' read as 2019887), or None."""
    if not text:
        return None
    numbers = _FINAL_NUMBER.findall(text)
    if not numbers:
        return None
    return Fraction(numbers[-1].replace(",", ""))


def answer_is_correct(final_answer: str | None, answer: str) -> bool:
    """Whether the last number of a final answer equals the reference exactly."""
    got = extract_final_number(final_answer)
    return got is not None and got == Fraction(answer)


class CalculatorEnvironment(ToolEnvironment):
    """Arithmetic with a `calculate` tool; reward 1 for the exact final answer.

    Problems are `a <op> b` with operands of `min_digits` to `max_digits` digits and `op` drawn from `operations`
    ('*' by default), seeded with `seed`; `num_eval` held-out problems never appear in training. Named rewards:
    'correct' (exact final answer) and 'used_tool' (a calculate call succeeded; weight 0 unless `reward_weights`
    gives it one). The reference completion, for warm start, is a correct tool-using transcript.

    Its arguments (`Args`) add the problems' to `ToolEnvironment`'s, with smaller defaults for the tool limits.
    """

    name = "calculator"
    reward_weights = {"correct": 1.0, "used_tool": 0.0}

    @dataclass
    class Args(ToolEnvironment.Args):
        # ToolEnvironment's limits, with defaults for short calculate calls
        max_turns: int = bounded(3, ge=1)
        tool_timeout_s: float = bounded(5.0, gt=0)
        max_tool_calls_per_turn: int = bounded(2, ge=1)
        max_tool_output_chars: int = bounded(200, ge=1)

        min_digits: int = bounded(3, ge=1, le=12)
        """Fewest digits of an operand."""
        max_digits: int = bounded(4, ge=1, le=12)
        """Most digits of an operand (at least min_digits)."""
        operations: str = "*"
        """The operations problems are drawn from, a string of '+', '-', '*'."""
        num_train: int = bounded(5000, ge=1)
        """Training problems."""
        num_eval: int = bounded(200, ge=1)
        """Held-out problems."""
        prompt_template: str = DEFAULT_PROMPT_TEMPLATE
        """The prompt, with `{expression}` where the problem goes."""

        def __post_init__(self):
            super().__post_init__()
            if self.min_digits > self.max_digits:
                raise ValueError(f"max_digits: must be >= min_digits ({self.min_digits}), got {self.max_digits}")
            if not self.operations or any(op not in OPERATIONS for op in self.operations):
                raise ValueError(f"operations: must be a string of {''.join(OPERATIONS)}, got {self.operations!r}")
            if "{expression}" not in self.prompt_template:
                raise ValueError(f"prompt_template: must contain '{{expression}}', got {self.prompt_template!r}")
            lo, hi = 10 ** (self.min_digits - 1), 10**self.max_digits - 1
            n_distinct = len(set(self.operations)) * (hi - lo + 1) ** 2
            if self.num_train + self.num_eval > n_distinct // 2:
                raise ValueError(
                    f"num_train: num_train + num_eval = {self.num_train + self.num_eval} is too many for "
                    f"{n_distinct} problems"
                )

    args: Args

    def __init__(self, tokenizer, **args):
        super().__init__(tokenizer, **args)
        min_digits, max_digits, operations = self.args.min_digits, self.args.max_digits, self.args.operations
        num_train, num_eval, prompt_template = self.args.num_train, self.args.num_eval, self.args.prompt_template
        lo, hi = 10 ** (min_digits - 1), 10**max_digits - 1
        rng = random.Random(self.seed)
        seen: set[str] = set()
        problems: list[Problem] = []
        while len(problems) < num_train + num_eval:
            a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(operations)
            expression = f"{a}{op}{b}"
            if expression in seen:
                continue
            seen.add(expression)
            problems.append(
                Problem(
                    id=expression,
                    prompt=prompt_template.format(expression=expression),
                    answer=str(OPERATIONS[op](a, b)),
                    fields={"expression": expression},
                )
            )
        self._eval, self._train = problems[:num_eval], problems[num_eval:]
        self.register_tool(calculate)

    def train_problems(self) -> list[Problem]:
        return self._train

    def eval_problems(self) -> list[Problem]:
        return self._eval

    async def episode_rewards(self, problem: Problem, conversation: Conversation) -> dict[str, float]:
        """'correct': the final answer's last number is the exact result; 'used_tool': a calculate call worked."""
        used = any(
            m["role"] == "tool" and m.get("name") == "calculate" and not m["content"].startswith("error:")
            for m in conversation.messages
        )
        correct = answer_is_correct(self.final_answer(conversation), problem.answer)
        return {"correct": float(correct), "used_tool": float(used)}

    def reference_messages(self, problem: Problem) -> list[dict]:
        """Call calculate on the problem's expression, read the result, answer with it."""
        expression = problem.fields["expression"]
        return [
            {"role": "assistant", "content": format_tool_call("calculate", {"expression": expression})},
            {"role": "tool", "name": "calculate", "content": calculate(expression)},
            {"role": "assistant", "content": problem.answer},
        ]


def final_number_correct(prompt: str, completion: str, prompt_ids, completion_ids, answer: str) -> float:
    """Reward function: 1 when the last number of `completion` is exactly `answer` (`answer_is_correct`), else 0."""
    return float(answer_is_correct(completion, answer))
