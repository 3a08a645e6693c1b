"""Problem data sets: JSONL or Parquet rows from a local path or any fsspec URL (`gs://...`), turned into `Problem`s.

Rows are read with plain fsspec + `json` / `pyarrow`, so nothing is downloaded or cached behind the user's back.
A path may be a glob (`gs://bucket/gsm8k/train-*.parquet`); compressed JSONL (`.jsonl.gz`, ...) is inferred from the
name. Every error names the file (and the line or row) and what was wrong with it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Any

import fsspec
import pyarrow.parquet as pq

from marin_rl.envs.base import Problem, SingleTurnEnvironment

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
GSM8K_SEPARATOR = "####"


class DataFormatError(ValueError):
    """A data file is missing, unreadable, or has a row without a required field (the message says which)."""


def _kind(path: str) -> str:
    name = path.lower()
    for ext in (".gz", ".bz2", ".xz", ".zst", ".zstd"):
        name = name.removesuffix(ext)
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    raise DataFormatError(f"{path}: unknown file type; expected one of {JSONL_SUFFIXES + PARQUET_SUFFIXES}")


def read_rows(path: str, *, storage_options: dict[str, Any] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """All rows of a JSONL or Parquet file (or of every file a glob matches, in sorted order).

    Returns `(location, row)` pairs; `location` ('FILE line N' or 'FILE row N') is for error messages.
    """
    files = fsspec.open_files(path, mode="rb", compression="infer", **(storage_options or {}))
    if not files:
        raise DataFormatError(f"{path}: no such file")
    rows: list[tuple[str, dict[str, Any]]] = []
    for of in sorted(files, key=lambda f: f.path):
        protocols = of.fs.protocol if isinstance(of.fs.protocol, tuple) else (of.fs.protocol,)
        name = of.path if "file" in protocols else of.full_name
        kind = _kind(of.path)
        try:
            with of as f:
                if kind == "parquet":
                    rows.extend((f"{name} row {i}", r) for i, r in enumerate(pq.read_table(f).to_pylist()))
                else:
                    rows.extend(_read_jsonl(f, name))
        except FileNotFoundError as e:
            raise DataFormatError(f"{name}: no such file") from e
        except DataFormatError:
            raise
        except Exception as e:  # pyarrow / decompression / IO errors: name the file
            raise DataFormatError(f"{name}: cannot read as {kind}: {type(e).__name__}: {e}") from e
    return rows


def _read_jsonl(f, name: str) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    for lineno, raw in enumerate(f, start=1):
        line = raw.decode("utf-8").strip()
        if not line:
            continue
        where = f"{name} line {lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataFormatError(f"{where}: invalid JSON: {e}") from e
        if not isinstance(row, dict):
            raise DataFormatError(f"{where}: expected a JSON object, got {type(row).__name__}")
        rows.append((where, row))
    return rows


def require_field(row: dict[str, Any], field: str, where: str) -> Any:
    """`row[field]`, or a `DataFormatError` naming the field, the location and the fields that are there."""
    value = row.get(field)
    if value is None:
        raise DataFormatError(f"{where}: missing field {field!r} (row has fields {sorted(row)})")
    return value


def parse_gsm8k_answer(solution: str, where: str = "answer") -> str:
    """The final number of a GSM8K solution ('...#### 1,234' → '1234')."""
    if GSM8K_SEPARATOR not in solution:
        raise DataFormatError(f"{where}: GSM8K answer has no {GSM8K_SEPARATOR!r} before the final answer")
    final = solution.rsplit(GSM8K_SEPARATOR, 1)[1].strip().replace(",", "")
    if not final:
        raise DataFormatError(f"{where}: GSM8K answer is empty after {GSM8K_SEPARATOR!r}")
    return final


def format_prompt(template: str, row: dict[str, Any], where: str) -> str:
    """`template` filled from the row's fields (`{question}` and any other field name)."""
    try:
        return template.format_map(row)
    except (KeyError, IndexError, ValueError) as e:
        raise DataFormatError(
            f"{where}: prompt template {template!r} cannot be filled from fields {sorted(row)}: {e}"
        ) from e


def _problem_id(row: dict[str, Any], path: str, index: int) -> str:
    if row.get("id") is not None:
        return str(row["id"])
    stem = PurePosixPath(path.split("://")[-1]).name.split(".")[0].replace("*", "all")
    return f"{stem}-{index}"


def source_rows(
    path: str | None,
    inline: list[dict[str, Any]] | None,
    what: str,
    storage_options: dict[str, Any] | None = None,
    path_arg: str = "path",
) -> list[tuple[str, dict[str, Any]]]:
    """`(location, row)` pairs from a file (`path`, see `read_rows`) or from rows given inline (a list of dicts,
    located as `what[i]`); exactly one of the two must be given (`path_arg` and `what` name them in the error)."""
    if (path is None) == (inline is None):
        raise ValueError(f"give exactly one of `{path_arg}` and `{what}`")
    if path is not None:
        return read_rows(path, storage_options=storage_options)
    if not isinstance(inline, list) or not all(isinstance(r, dict) for r in inline):
        raise ValueError(f"`{what}` must be a list of dicts (one per problem)")
    return [(f"{what}[{i}]", r) for i, r in enumerate(inline)]


def qa_problems(
    rows: list[tuple[str, dict[str, Any]]],
    source: str,
    *,
    question_field: str = "question",
    answer_field: str = "answer",
    prompt_template: str = "{question}",
    gsm8k: bool = False,
) -> list[Problem]:
    """Question/answer problems from `(location, row)` pairs read from `source` (a path, or a name for inline rows).

    The prompt is `prompt_template` filled with `question` (the question field) and the row's other fields. With
    `gsm8k=True` the answer field is a GSM8K solution and the reference answer is the number after '####'. The
    problem id is the row's `id` field if it has one, else '<source stem>-<row index>'. `fields` keeps the question
    and the raw answer ('solution').
    """
    problems = []
    for i, (where, row) in enumerate(rows):
        question = str(require_field(row, question_field, where))
        raw_answer = require_field(row, answer_field, where)
        answer = parse_gsm8k_answer(str(raw_answer), where) if gsm8k else str(raw_answer).strip()
        prompt = format_prompt(prompt_template, {**row, "question": question}, where)
        problems.append(
            Problem(
                id=_problem_id(row, source, i),
                prompt=prompt,
                answer=answer,
                fields={"question": question, "solution": raw_answer},
            )
        )
    return problems


def load_qa(
    path: str,
    *,
    question_field: str = "question",
    answer_field: str = "answer",
    prompt_template: str = "{question}",
    gsm8k: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> list[Problem]:
    """Question/answer problems from a JSONL or Parquet file (see `qa_problems`)."""
    rows = read_rows(path, storage_options=storage_options)
    return qa_problems(
        rows,
        path,
        question_field=question_field,
        answer_field=answer_field,
        prompt_template=prompt_template,
        gsm8k=gsm8k,
    )


def load_gsm8k(
    path: str, *, prompt_template: str = "{question}", storage_options: dict[str, Any] | None = None
) -> list[Problem]:
    """GSM8K-format problems: rows `{"question": ..., "answer": "<reasoning> #### 42"}` → answer '42'.

    Works on the released files (`train.jsonl` / `test.jsonl`, or the Hugging Face Parquet shards).
    """
    return load_qa(path, prompt_template=prompt_template, gsm8k=True, storage_options=storage_options)


def split_problems(problems: Sequence[Problem], eval_fraction: float, seed: int) -> tuple[list[Problem], list[Problem]]:
    """Shuffle with `seed` and hold out `eval_fraction` of the problems (at least one, leaving at least one)."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    if len(problems) < 2:
        raise ValueError(f"need at least 2 problems to split off an eval set, got {len(problems)}")
    shuffled = list(problems)
    random.Random(seed).shuffle(shuffled)
    n_eval = min(max(1, round(eval_fraction * len(shuffled))), len(shuffled) - 1)
    return shuffled[n_eval:], shuffled[:n_eval]


def train_eval_split(
    train: list[Problem], held_out: list[Problem] | None, eval_fraction: float, seed: int, name: str, source: str
) -> tuple[list[Problem], list[Problem]]:
    """`train` and `held_out`, or a seeded `eval_fraction` split of `train` when `held_out` is None; raises when
    either is empty or two problems share an id."""
    if held_out is None:
        train, held_out = split_problems(train, eval_fraction, seed)
    if not train or not held_out:
        raise ValueError(f"{name}: no training or no eval problems ({source})")
    check_unique_ids(train + held_out, source)
    return train, held_out


def check_unique_ids(problems: Sequence[Problem], what: str) -> None:
    """Raise if two problems share an id (ids key replay groups and metrics)."""
    seen: set[str] = set()
    for p in problems:
        if p.id in seen:
            raise DataFormatError(f"{what}: duplicate problem id {p.id!r}")
        seen.add(p.id)


class ProblemSetEnvironment(SingleTurnEnvironment):
    """A single-turn environment over fixed lists of training and held-out problems.

    Subclasses load their problems and call `set_problems`; the reference answer is the warm-start completion.
    """

    def set_problems(
        self, train: list[Problem], held_out: list[Problem] | None, eval_fraction: float, source: str
    ) -> None:
        """Use `train` and `held_out` (or a seeded `eval_fraction` split of `train` when None); ids must be unique."""
        self._train, self._eval = train_eval_split(train, held_out, eval_fraction, self.seed, self.name, source)

    def train_problems(self) -> list[Problem]:
        return self._train

    def eval_problems(self) -> list[Problem]:
        return self._eval

    def reference_completion(self, problem: Problem) -> str:
        """' <answer>' (the reference answer) as a warm-start completion."""
        return f" {problem.answer}"
