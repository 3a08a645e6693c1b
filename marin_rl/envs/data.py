"""Problem data sets: JSONL or Parquet rows from a local path or any fsspec URL (`gs://...`), turned into `Problem`s.

Rows are read with plain fsspec + `json` / `pyarrow`, so nothing is downloaded or cached behind the user's back.
A path may be a glob (`gs://bucket/gsm8k/train-*.parquet`); compressed JSONL (`.jsonl.gz`, ...) is inferred from the
name. Every error names the file (and the line or row) and what was wrong with it.

Every row is checked as it is loaded: a line that is not a JSON object, a missing or null field, a field of the
wrong type ('question' must be a string, not a number or an object) or an empty one is a `RowError` naming the
place ('train.jsonl:17', 'train.parquet:row 3', 'problems[2]') and the field:
`train.jsonl:17: field 'question': expected a string, got int 42`. By default such a row stops the load; an
environment given `skip_bad_rows: true` leaves it out and counts it instead (`BadRows`). A problem whose prompt
leaves no room for a sampled token within the run's `batcher.max_seq_len` is treated the same way
(`ProblemSetEnvironment`, `PromptTooLong`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import fsspec
import pyarrow.parquet as pq

from marin_rl.bounds import bounded
from marin_rl.envs.base import EnvArgs, Problem, SingleTurnEnvironment

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
GSM8K_SEPARATOR = "####"


logger = logging.getLogger("marin_rl")


class DataFormatError(ValueError):
    """A data file is missing, unreadable, or has a row without a required field (the message says which)."""


class RowError(DataFormatError):
    """One row is malformed (the message names its place and field); `skip_bad_rows` skips such rows."""

    kind = "malformed"
    """What `BadRows` counts it as."""


class PromptTooLong(RowError):
    """A problem's prompt leaves no room for a sampled token within the run's `max_seq_len`."""

    kind = "prompt_too_long"


class BadRows:
    """What a loader does with a malformed row: refuse it (a `RowError` naming the file, the line or row and the
    field), or, with `skip`, leave it out and count it (`counts`, by `RowError.kind`; `first`: the first message)."""

    def __init__(self, skip: bool = False):
        self.skip = skip
        self.counts: Counter[str] = Counter()
        self.first: dict[str, str] = {}

    @contextlib.contextmanager
    def check(self):
        """Around the handling of one row: a `RowError` inside propagates, or (with `skip`) is counted and ends the
        block quietly, so whatever the block would have kept of the row is not kept."""
        try:
            yield
        except RowError as e:
            if not self.skip:
                raise
            self.counts[e.kind] += 1
            self.first.setdefault(e.kind, str(e))

    @property
    def skipped(self) -> int:
        """Rows skipped so far, of every kind."""
        return sum(self.counts.values())


def describe(value: Any, limit: int = 60) -> str:
    """A value as an error message shows it: its JSON type and a short rendering ('int 42', "dict {'a': 1}")."""
    if value is None:
        return "null"
    shown = repr(value)
    if len(shown) > limit:
        shown = shown[: limit - 3] + "..."
    return f"{type(value).__name__} {shown}"


def _kind(path: str) -> str:
    name = path.lower()
    for ext in (".gz", ".bz2", ".xz", ".zst", ".zstd"):
        name = name.removesuffix(ext)
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    raise DataFormatError(f"{path}: unknown file type; expected one of {JSONL_SUFFIXES + PARQUET_SUFFIXES}")


def read_rows(
    path: str, *, storage_options: dict[str, Any] | None = None, bad_rows: BadRows | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """All rows of a JSONL or Parquet file (or of every file a glob matches, in sorted order).

    Returns `(location, row)` pairs; `location` ('FILE:N', N the line, or 'FILE:row N', N the Parquet row index) is
    for error messages. A JSONL line that is not a JSON object is a `RowError` (skipped and counted by `bad_rows`
    when it skips).
    """
    bad_rows = bad_rows or BadRows()
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
                    rows.extend((f"{name}:row {i}", r) for i, r in enumerate(pq.read_table(f).to_pylist()))
                else:
                    rows.extend(_read_jsonl(f, name, bad_rows))
        except FileNotFoundError as e:
            raise DataFormatError(f"{name}: no such file") from e
        except DataFormatError:
            raise
        except Exception as e:  # pyarrow / decompression / IO errors: name the file
            raise DataFormatError(f"{name}: cannot read as {kind}: {type(e).__name__}: {e}") from e
    return rows


def _read_jsonl(f, name: str, bad_rows: BadRows) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    for lineno, raw in enumerate(f, start=1):
        where = f"{name}:{lineno}"
        with bad_rows.check():
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise RowError(f"{where}: not UTF-8 text: {e}") from e
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise RowError(f"{where}: invalid JSON: {e}") from e
            if not isinstance(row, dict):
                raise RowError(f"{where}: expected a JSON object, got {describe(row)}")
            rows.append((where, row))
    return rows


def require_field(row: dict[str, Any], field: str, where: str) -> Any:
    """`row[field]`, or a `RowError` naming the location, the field and (when it is absent) the fields that are
    there."""
    if field not in row:
        raise RowError(f"{where}: field {field!r}: missing (the row has fields {sorted(row)})")
    value = row[field]
    if value is None:
        raise RowError(f"{where}: field {field!r}: null")
    return value


def text_field(row: dict[str, Any], field: str, where: str, *, allow_empty: bool = False) -> str:
    """`row[field]` as a string: a `RowError` when it is missing, null, not a string, or (unless `allow_empty`)
    empty or blank."""
    value = require_field(row, field, where)
    if not isinstance(value, str):
        raise RowError(f"{where}: field {field!r}: expected a string, got {describe(value)}")
    if not allow_empty and not value.strip():
        raise RowError(f"{where}: field {field!r}: empty")
    return value


def scalar_field(row: dict[str, Any], field: str, where: str) -> str:
    """`row[field]` as text when it is a non-empty string or a finite number (an answer such as 42 or '3/4');
    a `RowError` for anything else (null, a boolean, a list, an object, an empty string)."""
    value = require_field(row, field, where)
    if isinstance(value, str):
        if not value.strip():
            raise RowError(f"{where}: field {field!r}: empty")
        return value
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return str(value)
    raise RowError(f"{where}: field {field!r}: expected a string or a finite number, got {describe(value)}")


def parse_gsm8k_answer(solution: str, where: str = "answer") -> str:
    """The final number of a GSM8K solution ('...#### 1,234' → '1234')."""
    if GSM8K_SEPARATOR not in solution:
        raise RowError(f"{where}: GSM8K answer has no {GSM8K_SEPARATOR!r} before the final answer")
    final = solution.rsplit(GSM8K_SEPARATOR, 1)[1].strip().replace(",", "")
    if not final:
        raise RowError(f"{where}: GSM8K answer is empty after {GSM8K_SEPARATOR!r}")
    return final


def format_prompt(template: str, row: dict[str, Any], where: str) -> str:
    """`template` filled from the row's fields (`{question}` and any other field name)."""
    try:
        return template.format_map(row)
    except (KeyError, IndexError, ValueError) as e:
        raise RowError(f"{where}: prompt template {template!r} cannot be filled from fields {sorted(row)}: {e}") from e


def problem_id(row: dict[str, Any], where: str, default: str) -> str:
    """The row's `id` field (a non-empty string or an integer) as text, or `default` when the row has none."""
    value = row.get("id")
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, str | int) or (isinstance(value, str) and not value.strip()):
        raise RowError(f"{where}: field 'id': expected a non-empty string or an integer, got {describe(value)}")
    return str(value)


def _default_id(path: str, index: int) -> str:
    stem = PurePosixPath(path.split("://")[-1]).name.split(".")[0].replace("*", "all")
    return f"{stem}-{index}"


def source_rows(
    path: str | None,
    inline: list[dict[str, Any]] | None,
    what: str,
    storage_options: dict[str, Any] | None = None,
    path_arg: str = "path",
    bad_rows: BadRows | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """`(location, row)` pairs from a file (`path`, see `read_rows`) or from rows given inline (a list of dicts,
    located as `what[i]`); exactly one of the two must be given (`path_arg` and `what` name them in the error)."""
    if (path is None) == (inline is None):
        raise ValueError(f"give exactly one of `{path_arg}` and `{what}`")
    if path is not None:
        return read_rows(path, storage_options=storage_options, bad_rows=bad_rows)
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
    bad_rows: BadRows | None = None,
) -> list[Problem]:
    """Question/answer problems from `(location, row)` pairs read from `source` (a path, or a name for inline rows).

    The prompt is `prompt_template` filled with `question` (the question field) and the row's other fields. With
    `gsm8k=True` the answer field is a GSM8K solution and the reference answer is the number after '####'. The
    problem id is the row's `id` field if it has one, else '<source stem>-<row index>'. `fields` keeps the question
    and the raw answer ('solution'). The question must be a non-empty string, the answer a non-empty string or a
    number (a GSM8K solution: a string); a row that is not is a `RowError` (skipped and counted by `bad_rows` when
    it skips).
    """
    bad_rows = bad_rows or BadRows()
    problems = []
    for i, (where, row) in enumerate(rows):
        with bad_rows.check():
            question = text_field(row, question_field, where)
            if gsm8k:
                answer = parse_gsm8k_answer(text_field(row, answer_field, where), f"{where}: field {answer_field!r}")
            else:
                answer = scalar_field(row, answer_field, where).strip()
            prompt = format_prompt(prompt_template, {**row, "question": question}, where)
            problems.append(
                Problem(
                    id=problem_id(row, where, _default_id(source, i)),
                    prompt=prompt,
                    answer=answer,
                    fields={"question": question, "solution": row[answer_field]},
                    source=where,
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
    bad_rows: BadRows | None = None,
) -> list[Problem]:
    """Question/answer problems from a JSONL or Parquet file (see `qa_problems`)."""
    rows = read_rows(path, storage_options=storage_options, bad_rows=bad_rows)
    return qa_problems(
        rows,
        path,
        question_field=question_field,
        answer_field=answer_field,
        prompt_template=prompt_template,
        gsm8k=gsm8k,
        bad_rows=bad_rows,
    )


def load_gsm8k(
    path: str,
    *,
    prompt_template: str = "{question}",
    storage_options: dict[str, Any] | None = None,
    bad_rows: BadRows | None = None,
) -> list[Problem]:
    """GSM8K-format problems: rows `{"question": ..., "answer": "<reasoning> #### 42"}` → answer '42'.

    Works on the released files (`train.jsonl` / `test.jsonl`, or the Hugging Face Parquet shards).
    """
    return load_qa(
        path, prompt_template=prompt_template, gsm8k=True, storage_options=storage_options, bad_rows=bad_rows
    )


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
    """Raise if two problems share an id (ids key replay groups and metrics), naming where both were read."""
    seen: dict[str, Problem] = {}
    for p in problems:
        first = seen.setdefault(p.id, p)
        if first is not p:
            where = f" ({first.source} and {p.source})" if first.source and p.source else ""
            raise DataFormatError(f"{what}: duplicate problem id {p.id!r}{where}")


PROMPT_CHUNK = 4096
"""Prompts tokenized per call when `ProblemSetEnvironment` measures them at load."""


@dataclass(kw_only=True)
class ProblemSourceArgs(EnvArgs):
    """The arguments of an environment that reads question/answer rows (`source_rows`): from a file or inline, and
    its held-out problems likewise, else a seeded split. Mixed into an environment's `Args`."""

    path: str | None = None
    """A JSONL or Parquet file of problems (local or `gs://`); or `problems`."""
    problems: list[dict[str, Any]] | None = None
    """Problems inline, as rows."""
    eval_path: str | None = None
    """A file of held-out problems (at most one of `eval_path` and `eval_problems`; neither: `eval_fraction` of the
    problems is held out after a shuffle seeded with `seed`)."""
    eval_problems: list[dict[str, Any]] | None = None
    """Held-out problems inline, as rows."""
    eval_fraction: float = 0.1
    """The share of the problems held out when there are no held-out ones, in (0, 1)."""
    question_field: str = "question"
    """The question's column."""
    answer_field: str = "answer"
    """The answer's column."""

    def __post_init__(self):
        super().__post_init__()
        if self.eval_path is not None and self.eval_problems is not None:
            raise ValueError("eval_problems: give at most one of `eval_path` and `eval_problems`")


class ProblemSetEnvironment(SingleTurnEnvironment):
    """A single-turn environment over fixed lists of training and held-out problems.

    Subclasses load their problems (passing `bad_rows` to the loaders) and call `set_problems`; the reference answer
    is the warm-start completion.

    `skip_bad_rows` (an env arg): leave out malformed rows and problems whose prompt does not fit, counted
    (`data_report`, logged at load), instead of refusing the data with an error naming the first one.
    `max_seq_len` (the run passes its `batcher.max_seq_len`, see `marin_rl.config.make_environment`): a problem
    whose prompt takes `max_seq_len` tokens or more leaves no room for a sampled token and is refused (or skipped);
    None: no length check.
    """

    driver_check = True

    @dataclass(kw_only=True)
    class Args(SingleTurnEnvironment.Args):
        skip_bad_rows: bool = False
        """Leave out (and count) malformed rows and problems whose prompt does not fit `max_seq_len`, instead of
        refusing the data with an error naming the first one."""
        max_seq_len: int | None = bounded(None, ge=1)
        """Given by the run (its `batcher.max_seq_len`): longer prompts are refused (or skipped); None: no check."""

    args: Args

    def __init__(self, tokenizer, **args):
        super().__init__(tokenizer, **args)
        self.bad_rows = BadRows(skip=self.args.skip_bad_rows)
        """Malformed rows and over-long prompts: refused, or skipped and counted."""
        self.max_seq_len = self.args.max_seq_len

    def set_problems(
        self, train: list[Problem], held_out: list[Problem] | None, eval_fraction: float, source: str
    ) -> None:
        """Use `train` and `held_out` (or a seeded `eval_fraction` split of `train` when None), without the problems
        whose prompt does not fit `max_seq_len`; ids must be unique. Logs what `skip_bad_rows` left out."""
        train = self.fitting(train)
        held_out = None if held_out is None else self.fitting(held_out)
        if self.bad_rows.skipped and (not train or held_out == []):
            raise DataFormatError(
                f"{self.name}: no problems left after skipping {self.bad_rows.skipped} bad row(s) of {source}; "
                f"the first: {next(iter(self.bad_rows.first.values()))}"
            )
        self._train, self._eval = train_eval_split(train, held_out, eval_fraction, self.seed, self.name, source)
        counts, first = self.bad_rows.counts, self.bad_rows.first
        if counts[RowError.kind]:
            logger.warning(
                "%s: skip_bad_rows left out %d malformed row(s) of %s; the first: %s",
                self.name,
                counts[RowError.kind],
                source,
                first[RowError.kind],
            )
        if counts[PromptTooLong.kind]:
            logger.warning(
                "%s: skip_bad_rows left out %d problem(s) of %s whose prompt does not fit max_seq_len=%d; "
                "the first: %s",
                self.name,
                counts[PromptTooLong.kind],
                source,
                self.max_seq_len,
                first[PromptTooLong.kind],
            )

    def fitting(self, problems: list[Problem]) -> list[Problem]:
        """`problems` without those whose prompt leaves no room for one sampled token within `max_seq_len`: a
        `PromptTooLong` naming the first such problem (its file and line), or, with `skip_bad_rows`, counted."""
        if self.max_seq_len is None:
            return list(problems)
        kept = []
        for start in range(0, len(problems), PROMPT_CHUNK):
            chunk = problems[start : start + PROMPT_CHUNK]
            if self.chat:
                encoded = [self.encode_prompt(p) for p in chunk]
            else:
                encoded = self.tokenizer([p.prompt for p in chunk], add_special_tokens=False)["input_ids"]
            for problem, ids in zip(chunk, encoded, strict=True):
                with self.bad_rows.check():
                    if len(ids) + 1 > self.max_seq_len:
                        raise PromptTooLong(
                            f"{problem.source or f'problem {problem.id!r}'}: prompt of {len(ids)} tokens leaves no "
                            f"room for a sampled token within max_seq_len={self.max_seq_len} (batcher.max_seq_len)"
                        )
                    kept.append(problem)
        return kept

    def use_chat_template(self, system_prompt: str | None = None) -> None:
        """As `SingleTurnEnvironment.use_chat_template`; the loaded problems are checked against `max_seq_len` again,
        with their rendered prompts."""
        super().use_chat_template(system_prompt)
        self._train, self._eval = self.fitting(self._train), self.fitting(self._eval)
        if not self._train or not self._eval:
            raise DataFormatError(
                f"{self.name}: no {'training' if not self._train else 'held-out'} problems fit max_seq_len="
                f"{self.max_seq_len} once rendered with the chat template"
            )

    def data_report(self) -> dict[str, int]:
        """The problem counts, and the rows `skip_bad_rows` left out: `skipped_malformed_rows`,
        `skipped_long_prompts`."""
        return {
            **super().data_report(),
            "skipped_malformed_rows": self.bad_rows.counts[RowError.kind],
            "skipped_long_prompts": self.bad_rows.counts[PromptTooLong.kind],
        }

    def train_problems(self) -> list[Problem]:
        return self._train

    def eval_problems(self) -> list[Problem]:
        return self._eval

    def reference_completion(self, problem: Problem) -> str:
        """' <answer>' (the reference answer) as a warm-start completion."""
        return f" {problem.answer}"
