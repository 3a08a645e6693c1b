"""Math word problems (GSM8K-style) with a symbolic verifier.

The verifier extracts the completion's final answer (the last `\\boxed{...}`, else what follows the last '####',
else the last number or fraction in the text) and compares it with the reference exactly, with sympy: '0.5',
'1/2' and '\\frac{1}{2}' are the same answer, as are '1,000' and '1000'. Answers that are not numbers or
simple expressions are compared as normalized text. Malformed output scores 0; the verifier never raises.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import sympy
from sympy.parsing.sympy_parser import parse_expr, rationalize, standard_transformations

from marin_rl.envs.base import Problem
from marin_rl.envs.data import ProblemSetEnvironment, load_gsm8k, load_qa

DEFAULT_PROMPT_TEMPLATE = "Question: {question}\nAnswer:"
FORMATS = ("gsm8k", "jsonl")
DEMONSTRATIONS = ("answer", "solution")

_MAX_ANSWER_CHARS = 200
_MAX_EXPONENT = 1000
_TRANSFORMS = standard_transformations + (rationalize,)
# What a parsed answer may contain: numbers, arithmetic, parentheses, sqrt and pi. Anything else is not parsed
# (sympy's parser evaluates Python, so model output is never passed to it unchecked).
_SAFE_EXPR = re.compile(r"(?:[0-9.+\-*/()\s]|sqrt|pi)+")
_NUMBER = re.compile(
    r"\\[dt]?frac\{[^{}]*\}\{[^{}]*\}"  # \frac{a}{b}
    r"|(?:(?<![\d)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?"  # -1,234.5 or 3/4
    r"|(?:(?<![\d)])-)?\.\d+"  # .5
)


def _braced(text: str, open_at: int) -> str | None:
    """Contents of the brace group starting at `text[open_at] == '{'`, or None if it is not closed."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
    return None


def _last_boxed(text: str) -> str | None:
    for m in reversed(list(re.finditer(r"\\(?:boxed|fbox)\s*\{", text))):
        inner = _braced(text, m.end() - 1)
        if inner is not None:
            return inner
    return None


def extract_answer(completion: str) -> str | None:
    """The final answer of a completion: last `\\boxed{...}`, else after the last '####', else the last number."""
    if not completion:
        return None
    boxed = _last_boxed(completion)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    if "####" in completion:
        tail = completion.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
        if tail:
            return tail
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def _replace_frac(s: str) -> str:
    """'\\frac{a}{b}' → '((a)/(b))', nested ones too; unbalanced input is left as is (and later rejected)."""
    for _ in range(20):
        m = re.search(r"\\frac\s*\{", s)
        if m is None:
            return s
        num = _braced(s, m.end() - 1)
        if num is None:
            return s
        den_open = m.end() + len(num) + 1
        while den_open < len(s) and s[den_open].isspace():
            den_open += 1
        den = _braced(s, den_open) if den_open < len(s) and s[den_open] == "{" else None
        if den is None:
            return s
        s = s[: m.start()] + f"(({num})/({den}))" + s[den_open + len(den) + 2 :]
    return s


def _to_python_syntax(answer: str) -> str:
    s = answer.strip()
    s = re.sub(r"\\text\s*\{[^{}]*\}|\\mathrm\s*\{[^{}]*\}", "", s)  # units: 18 \text{ dollars}
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "$", "%", "\\%"):
        s = s.replace(token, "")
    s = _replace_frac(s)
    s = re.sub(r"\\sqrt\s*\{([^{}]*)\}", r"sqrt(\1)", s)
    s = s.replace("\\pi", "pi").replace("\\cdot", "*").replace("\\times", "*").replace("^", "**")
    s = s.replace("{", "(").replace("}", ")")
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # thousands separators
    s = s.strip().rstrip(".").strip()
    s = re.sub(r"(?<![\d.])0+(?=\d)", "", s)  # leading zeros: '007' → '7'
    s = re.sub(r"(?<=[\d)])\s*(?=sqrt|pi|\()", "*", s)  # implicit products: '2sqrt(2)', '3pi'
    return s


def _bounded_powers(expr: sympy.Expr) -> bool:
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Pow):
            exponent = node.exp
            if not (exponent.is_Number and abs(exponent) <= _MAX_EXPONENT):
                return False
    return True


def parse_answer(answer: str) -> sympy.Expr | None:
    """A numeric sympy expression for an answer string ('1,000', '-3.5', '\\frac{1}{2}', '2\\sqrt{2}'), or None."""
    if not answer or len(answer) > _MAX_ANSWER_CHARS:
        return None
    s = _to_python_syntax(answer)
    if not s or not _SAFE_EXPR.fullmatch(s) or not re.search(r"\d|pi", s):
        return None
    try:
        unevaluated = parse_expr(s, transformations=_TRANSFORMS, evaluate=False)
        if not _bounded_powers(unevaluated):
            return None
        expr = parse_expr(s, transformations=_TRANSFORMS)
    except Exception:  # syntax errors, zero division, anything the parser throws at malformed text
        return None
    if not isinstance(expr, sympy.Expr) or not expr.is_number or expr.has(sympy.zoo, sympy.nan, sympy.oo):
        return None
    return expr


def _normalize_text(s: str) -> str:
    return re.sub(r"\s+", "", s).strip().rstrip(".").lower()


def answers_match(predicted: str | None, reference: str) -> bool:
    """Whether two final answers are equal: exactly as numbers when both parse, else as normalized text."""
    if predicted is None or not predicted.strip():
        return False
    a, b = parse_answer(predicted), parse_answer(reference)
    if a is not None and b is not None:
        try:
            diff = sympy.simplify(a - b)
            if diff == 0:
                return True
            if a.is_rational and b.is_rational:
                return False
            return bool(abs(sympy.N(diff, 30)) <= 1e-12 * max(1, abs(sympy.N(b, 30))))
        except Exception:
            return False
    if b is not None:  # numeric reference, unparseable prediction
        return False
    return _normalize_text(predicted) == _normalize_text(reference)


def verify(completion: str, reference: str) -> float:
    """1.0 if the completion's final answer equals `reference`, else 0.0 (never raises)."""
    try:
        return float(answers_match(extract_answer(completion), reference))
    except Exception:
        return 0.0


class MathEnvironment(ProblemSetEnvironment):
    """Math word problems from JSONL/Parquet files (local or `gs://`), rewarded 1 for a correct final answer.

    Its arguments are `Args` (the env's `args` in the config).
    """

    name = "math"

    @dataclass(kw_only=True)
    class Args(ProblemSetEnvironment.Args):
        train_path: str
        """File (or glob) of training problems."""
        eval_path: str | None = None
        """File of held-out problems; None: `eval_fraction` of `train_path` is held out after a shuffle seeded with
        `seed`."""
        eval_fraction: float = 0.1
        """The share of `train_path` held out when there is no `eval_path`, in (0, 1)."""
        format: str = "gsm8k"
        """'gsm8k' (rows `question`, `answer` = '<solution> #### 42') or 'jsonl' (the answer field is the final
        answer itself; Parquet files are fine too)."""
        question_field: str = "question"
        """The question's column, for format 'jsonl'."""
        answer_field: str = "answer"
        """The answer's column, for format 'jsonl'."""
        prompt_template: str = DEFAULT_PROMPT_TEMPLATE
        """Filled with `{question}` (and any other field of the row)."""
        storage_options: dict[str, Any] | None = None
        """Passed to fsspec (e.g. credentials for `gs://`)."""
        demonstration: str = "answer"
        """The warm-start completion: 'answer' (' ' + the final answer) or 'solution' (format 'gsm8k': the row's
        worked solution, '... #### 42', with its '<<48/2=24>>' calculator annotations removed)."""

        def __post_init__(self):
            super().__post_init__()
            if self.format not in FORMATS:
                raise ValueError(f"format: must be one of {FORMATS}, got {self.format!r}")
            if self.demonstration not in DEMONSTRATIONS or (
                self.demonstration == "solution" and self.format != "gsm8k"
            ):
                raise ValueError(
                    f"demonstration: must be 'answer', or 'solution' (format gsm8k), got {self.demonstration!r}"
                )
            if self.format == "gsm8k" and (self.question_field, self.answer_field) != ("question", "answer"):
                which = "question_field" if self.question_field != "question" else "answer_field"
                raise ValueError(f"{which}: applies to format 'jsonl'; GSM8K rows use question/answer")

    args: Args

    def __init__(self, tokenizer, **args):
        super().__init__(tokenizer, **args)
        a = self.args
        format, prompt_template, storage_options = a.format, a.prompt_template, a.storage_options
        train_path, eval_path = a.train_path, a.eval_path

        def load(path: str) -> list[Problem]:
            if format == "gsm8k":
                return load_gsm8k(
                    path, prompt_template=prompt_template, storage_options=storage_options, bad_rows=self.bad_rows
                )
            return load_qa(
                path,
                question_field=a.question_field,
                answer_field=a.answer_field,
                prompt_template=prompt_template,
                storage_options=storage_options,
                bad_rows=self.bad_rows,
            )

        self.set_problems(
            load(train_path),
            None if eval_path is None else load(eval_path),
            a.eval_fraction,
            train_path if eval_path is None else f"{train_path} and {eval_path}",
        )

    def reference_completion(self, problem: Problem) -> str:
        """The final answer (' 42'), or with `demonstration: solution` the worked solution without annotations."""
        if self.args.demonstration == "solution":
            return re.sub(r"<<[^<>]*>>", "", str(problem.fields["solution"]))
        return super().reference_completion(problem)

    def score(self, problem: Problem, completion: str) -> dict[str, float]:
        return {"correct": verify(completion, problem.answer)}
