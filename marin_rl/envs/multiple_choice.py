"""Multiple-choice questions: the prompt lists lettered options, reward 1 for the right letter."""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Any

from marin_rl.envs.base import Problem
from marin_rl.envs.data import (
    BadRows,
    ProblemSetEnvironment,
    ProblemSourceArgs,
    RowError,
    describe,
    problem_id,
    require_field,
    source_rows,
    text_field,
)

LETTERS = string.ascii_uppercase
DEFAULT_PROMPT_TEMPLATE = "Question: {question}\n{options}\nAnswer:"


def answer_letter(answer: Any, num_choices: int, where: str) -> str:
    """The answer as a letter: an index (0 → 'A', also as a string '0') or a letter ('b', '(B)')."""
    if isinstance(answer, bool):
        raise RowError(f"{where}: expected an option index or letter, got {describe(answer)}")
    if isinstance(answer, int):
        index = answer
    elif isinstance(answer, str) and answer.strip().isdigit():
        index = int(answer.strip())
    elif isinstance(answer, str) and len(answer.strip("() .").strip()) == 1 and answer.strip("() .").isalpha():
        index = LETTERS.index(answer.strip("() .").upper())
    else:
        raise RowError(f"{where}: expected an option index or letter, got {describe(answer)}")
    if not 0 <= index < num_choices:
        raise RowError(f"{where}: {answer!r} is not one of the {num_choices} options")
    return LETTERS[index]


def make_problem(
    row: dict[str, Any],
    where: str,
    index: int,
    *,
    question_field: str = "question",
    choices_field: str = "choices",
    answer_field: str = "answer",
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
    id_prefix: str = "mc",
) -> Problem:
    """A `Problem` from one row `{question, choices: [...], answer: index or letter}`; `where` locates errors (a
    `RowError` naming the field: the question must be a non-empty string, the choices 2 to 26 non-empty strings or
    numbers)."""
    question = text_field(row, question_field, where)
    choices = require_field(row, choices_field, where)
    if not isinstance(choices, list | tuple) or not 2 <= len(choices) <= len(LETTERS):
        raise RowError(f"{where}: field {choices_field!r}: expected a list of 2 to 26 options, got {describe(choices)}")
    for i, c in enumerate(choices):
        number = isinstance(c, int | float) and not isinstance(c, bool)
        if not (number or (isinstance(c, str) and c.strip())):
            raise RowError(f"{where}: field {choices_field!r}[{i}]: expected a non-empty string, got {describe(c)}")
    choices = [str(c) for c in choices]
    letter = answer_letter(require_field(row, answer_field, where), len(choices), f"{where}: field {answer_field!r}")
    options = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(choices))
    try:
        prompt = prompt_template.format(question=question, options=options)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"prompt_template {prompt_template!r} may use only {{question}} and {{options}}: {e}") from e
    return Problem(
        id=problem_id(row, where, f"{id_prefix}-{index}"),
        prompt=prompt,
        answer=letter,
        fields={"question": question, "choices": choices},
        source=where,
    )


def make_problems(rows: list[tuple[str, dict[str, Any]]], bad_rows: BadRows, **options) -> list[Problem]:
    """`make_problem` of each `(location, row)`; a malformed row is refused or, when `bad_rows` skips, counted."""
    problems = []
    for i, (where, row) in enumerate(rows):
        with bad_rows.check():
            problems.append(make_problem(row, where, i, **options))
    return problems


def extract_choice(completion: str, num_choices: int = len(LETTERS)) -> str | None:
    """The first option letter in a completion: a capital letter among the first `num_choices` standing alone.

    ' B', '(B)', 'B.', 'B) because', 'Answer: B' and 'The answer is B' all give 'B'; a capital inside a word
    ('Answer') or beyond the options ('I think C' with 4 options gives 'C') is skipped.
    """
    valid = LETTERS[:num_choices]
    for m in re.finditer(r"(?<![A-Za-z0-9])([A-Z])(?![A-Za-z0-9])", completion or ""):
        if m.group(1) in valid:
            return m.group(1)
    return None


class MultipleChoiceEnvironment(ProblemSetEnvironment):
    """Multiple-choice questions; reward 1 if the completion's first option letter is the answer.

    Problems come from `path` (JSONL or Parquet, local or `gs://`, rows `{"question", "choices": [...],
    "answer": index or letter}`; field names configurable) or inline as `problems` (a list of such dicts).
    Held out: `eval_path` / `eval_problems`, else `eval_fraction` of the problems after a shuffle seeded with `seed`.
    The prompt is `prompt_template` with `{question}` and `{options}` ('A. ...' lines). `skip_bad_rows` and
    `max_seq_len` (given by the run) as in `ProblemSetEnvironment`.
    """

    name = "multiple_choice"

    @dataclass(kw_only=True)
    class Args(ProblemSetEnvironment.Args, ProblemSourceArgs):
        choices_field: str = "choices"
        """The column of the list of options."""
        answer_field: str = "answer"
        """The answer's column: the right option's index or letter."""
        prompt_template: str = DEFAULT_PROMPT_TEMPLATE
        """Filled with `{question}` and `{options}` ('A. ...' lines)."""
        storage_options: dict[str, Any] | None = None
        """Passed to fsspec (e.g. credentials for `gs://`)."""

    args: Args

    def __init__(self, tokenizer, **args):
        super().__init__(tokenizer, **args)
        a = self.args
        fields = dict(
            question_field=a.question_field,
            choices_field=a.choices_field,
            answer_field=a.answer_field,
            prompt_template=a.prompt_template,
        )

        def load(source_path: str | None, inline: list[dict] | None, prefix: str) -> list[Problem]:
            rows = source_rows(
                source_path,
                inline,
                prefix,
                a.storage_options,
                path_arg=prefix.replace("problems", "path"),
                bad_rows=self.bad_rows,
            )
            return make_problems(rows, self.bad_rows, id_prefix=prefix, **fields)

        held_out = (
            None
            if a.eval_path is None and a.eval_problems is None
            else load(a.eval_path, a.eval_problems, "eval_problems")
        )
        self.set_problems(load(a.path, a.problems, "problems"), held_out, a.eval_fraction, self.name)

    def score(self, problem: Problem, completion: str) -> dict[str, float]:
        num_choices = len(problem.fields.get("choices", LETTERS))
        return {"correct": float(extract_choice(completion, num_choices) == problem.answer)}
