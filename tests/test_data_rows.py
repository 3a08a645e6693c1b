"""Problem files are checked row by row at load: each kind of malformed row is refused with its file, line (or
Parquet row) and field; `skip_bad_rows` skips and counts them; a prompt that cannot fit `max_seq_len` is named at
load; the driver loads the data before anything starts and the command line prints one line."""

import json
import logging
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from marin_rl.config import EnvConfig, make_environment, parse_config
from marin_rl.envs.data import DataFormatError, PromptTooLong, RowError
from marin_rl.envs.math import MathEnvironment
from marin_rl.envs.multiple_choice import MultipleChoiceEnvironment
from marin_rl.orchestrator.preflight import RunRefused, check_environment_data
from marin_rl.tokenizer import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[1]

GOOD = [{"question": f"What is {i} plus {i}?", "answer": f"{i}+{i} #### {2 * i}"} for i in range(1, 6)]
QA_GOOD = [{"question": f"{i}+{i}=", "answer": 2 * i} for i in range(1, 6)]
MC_GOOD = [{"question": f"{i}+1?", "choices": [str(i), str(i + 1)], "answer": 1} for i in range(1, 6)]


@pytest.fixture
def tok():
    return build_char_tokenizer()


def write_lines(path, lines: list[str]) -> str:
    """A JSONL file of these lines (raw text: rows need not be valid)."""
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def jsonl_with(path, bad_line: str, good=GOOD) -> str:
    """Two good rows, a blank line, the bad line (line 4), then the other good rows."""
    lines = [json.dumps(r) for r in good[:2]] + ["", bad_line] + [json.dumps(r) for r in good[2:]]
    return write_lines(path, lines)


# ---- each kind of malformed row, refused with file, line and field -------------------------------------------------

GSM8K_BAD = [
    ('{"question": 42, "answer": "#### 1"}', "field 'question': expected a string, got int 42"),
    (
        '{"question": {"text": "hi"}, "answer": "#### 1"}',
        "field 'question': expected a string, got dict {'text': 'hi'}",
    ),
    ('{"question": ["a"], "answer": "#### 1"}', "field 'question': expected a string, got list ['a']"),
    ('{"question": "   ", "answer": "#### 1"}', "field 'question': empty"),
    ('{"answer": "#### 1"}', "field 'question': missing (the row has fields ['answer'])"),
    ('{"question": "q", "answer": null}', "field 'answer': null"),
    ('{"question": "q", "answer": 7}', "field 'answer': expected a string, got int 7"),
    ('{"question": "q", "answer": "seven"}', "field 'answer': GSM8K answer has no '####'"),
    ('{"question": "q", "answer": "#### 1", "id": {"a": 1}}', "field 'id': expected a non-empty string or an integer"),
    ('{"question": "q", "answer": "#### 1"', "invalid JSON"),
    ("[1, 2]", "expected a JSON object, got list [1, 2]"),
    ('"just a string"', "expected a JSON object, got str 'just a string'"),
]


@pytest.mark.parametrize("line, message", GSM8K_BAD)
def test_each_malformed_gsm8k_row_is_refused_naming_file_line_and_field(tok, tmp_path, line, message):
    path = jsonl_with(tmp_path / "train.jsonl", line)
    with pytest.raises(RowError) as err:
        MathEnvironment(tok, train_path=path)
    assert str(err.value).startswith(f"{path}:4: "), str(err.value)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "value, message",
    [
        (True, "expected a string or a finite number, got bool True"),
        ({"x": 1}, "expected a string or a finite number, got dict {'x': 1}"),
        ("", "field 'answer': empty"),
        (float("nan"), "expected a string or a finite number, got float nan"),
    ],
)
def test_qa_answers_must_be_text_or_numbers(tok, tmp_path, value, message):
    rows = [*QA_GOOD[:3], {"question": "q", "answer": value}, *QA_GOOD[3:]]
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RowError, match=rf"qa\.jsonl:4: .*{message[:30]}"):
        MathEnvironment(tok, train_path=str(path), format="jsonl")
    # numbers and text are answers: the same file without the bad row loads
    rows.pop(3)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = MathEnvironment(tok, train_path=str(path), format="jsonl")
    assert sorted(p.answer for p in env.train_problems() + env.eval_problems()) == ["10", "2", "4", "6", "8"]


def test_parquet_rows_are_named_by_index_and_column_types_are_checked(tok, tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"question": 7, "answer": "#### 1"}, {"question": 8, "answer": "#### 2"}]), path
    )
    with pytest.raises(RowError, match=r"train\.parquet:row 0: field 'question': expected a string, got int 7"):
        MathEnvironment(tok, train_path=str(path))
    pq.write_table(pa.Table.from_pylist([*GOOD[:3], {"question": None, "answer": "#### 2"}]), path)
    with pytest.raises(RowError, match=r"train\.parquet:row 3: field 'question': null"):
        MathEnvironment(tok, train_path=str(path))


def test_multiple_choice_rows_are_checked_field_by_field(tok, tmp_path):
    cases = [
        ({"question": 3, "choices": ["a", "b"], "answer": 0}, "field 'question': expected a string, got int 3"),
        ({"question": "q", "choices": ["a", None], "answer": 0}, "field 'choices'[1]: expected a non-empty string"),
        ({"question": "q", "choices": "ab", "answer": 0}, "field 'choices': expected a list of 2 to 26 options"),
        ({"question": "q", "choices": ["a", "b"], "answer": [0]}, "field 'answer': expected an option index or letter"),
        ({"question": "q", "choices": ["a", "b"], "answer": 2}, "field 'answer': 2 is not one of the 2 options"),
    ]
    for row, message in cases:
        path = jsonl_with(tmp_path / "mc.jsonl", json.dumps(row), MC_GOOD)
        with pytest.raises(RowError) as err:
            MultipleChoiceEnvironment(tok, path=path)
        assert str(err.value).startswith(f"{path}:4: ") and message in str(err.value), str(err.value)
    with pytest.raises(RowError, match=r"problems\[1\]: field 'question': empty"):
        MultipleChoiceEnvironment(tok, problems=[MC_GOOD[0], {"question": "", "choices": ["a", "b"], "answer": 0}])


def test_duplicate_ids_name_both_rows(tok, tmp_path):
    rows = [{**r, "id": "same" if i in (1, 3) else f"r{i}"} for i, r in enumerate(GOOD)]
    path = write_lines(tmp_path / "dup.jsonl", [json.dumps(r) for r in rows])
    with pytest.raises(DataFormatError, match="duplicate problem id 'same'") as err:
        MathEnvironment(tok, train_path=path)
    assert f"{path}:2" in str(err.value) and f"{path}:4" in str(err.value)


# ---- skip_bad_rows --------------------------------------------------------------------------------------------------


def test_skip_bad_rows_skips_counts_and_logs_every_kind(tok, tmp_path, caplog):
    bad = [line for line, _ in GSM8K_BAD]
    lines = [json.dumps(GOOD[0]), *bad[:6], json.dumps(GOOD[1]), *bad[6:], *(json.dumps(r) for r in GOOD[2:])]
    path = write_lines(tmp_path / "mixed.jsonl", lines)
    # refused by default (the file is parsed before the rows' fields are checked: the unparsable line comes first)
    with pytest.raises(RowError, match=r"mixed\.jsonl:12: invalid JSON"):
        make_environment(
            EnvConfig(name="m", env_class="marin_rl.envs.math:MathEnvironment", args={"train_path": path}), tok, 0
        )
    config = EnvConfig(
        name="m", env_class="marin_rl.envs.math:MathEnvironment", args={"train_path": path, "skip_bad_rows": True}
    )
    with caplog.at_level(logging.WARNING, logger="marin_rl"):
        env = make_environment(config, tok, seed=0)
    kept = env.train_problems() + env.eval_problems()
    assert sorted(p.fields["question"] for p in kept) == sorted(r["question"] for r in GOOD)
    assert env.data_report() == {
        "train_problems": len(env.train_problems()),
        "eval_problems": len(env.eval_problems()),
        "skipped_malformed_rows": len(GSM8K_BAD),
        "skipped_long_prompts": 0,
    }
    [record] = [r.getMessage() for r in caplog.records if "skip_bad_rows" in r.getMessage()]
    assert record.startswith(f"m: skip_bad_rows left out {len(GSM8K_BAD)} malformed row(s) of {path}; the first: ")
    assert record.endswith(f"{path}:12: invalid JSON: Expecting ',' delimiter: line 1 column 37 (char 36)")


def test_skip_bad_rows_with_nothing_left_names_the_first_bad_row(tok, tmp_path):
    path = write_lines(tmp_path / "all_bad.jsonl", ['{"question": 1, "answer": "#### 1"}', "{oops"])
    with pytest.raises(
        DataFormatError, match=r"no problems left after skipping 2 bad row\(s\).*all_bad\.jsonl:2: invalid JSON"
    ):
        MathEnvironment(tok, train_path=path, skip_bad_rows=True)
    with pytest.raises(ValueError, match="skip_bad_rows: expected bool, got str 'yes'"):
        MathEnvironment(tok, train_path=path, skip_bad_rows="yes")


# ---- prompts that cannot fit max_seq_len ---------------------------------------------------------------------------


def test_a_prompt_that_cannot_fit_max_seq_len_is_named_at_load(tok, tmp_path, caplog):
    template = "{question}"
    limit = 24
    rows = [{"question": "x" * n, "answer": "#### 1"} for n in (3, 4, limit - 1, 5, limit, 6)]
    path = write_lines(tmp_path / "long.jsonl", [json.dumps(r) for r in rows])
    assert len(tok("x" * limit, add_special_tokens=False)["input_ids"]) == limit  # one token per character
    config = EnvConfig(
        name="m", env_class="marin_rl.envs.math:MathEnvironment", args={"train_path": path, "prompt_template": template}
    )
    # the run passes its batcher.max_seq_len to environments that take it
    with pytest.raises(PromptTooLong) as err:
        make_environment(config, tok, seed=0, max_seq_len=limit)
    assert str(err.value) == (
        f"{path}:5: prompt of {limit} tokens leaves no room for a sampled token within max_seq_len={limit} "
        "(batcher.max_seq_len)"
    )
    config.args["skip_bad_rows"] = True
    with caplog.at_level(logging.WARNING, logger="marin_rl"):
        env = make_environment(config, tok, seed=0, max_seq_len=limit)
    kept = sorted(len(p.prompt) for p in env.train_problems() + env.eval_problems())
    assert kept == [3, 4, 5, 6, limit - 1]  # prompt + 1 sampled token = max_seq_len still fits
    assert env.data_report()["skipped_long_prompts"] == 1 and env.data_report()["skipped_malformed_rows"] == 0
    logged = [r.getMessage() for r in caplog.records if "skip_bad_rows" in r.getMessage()]
    assert logged == [
        f"m: skip_bad_rows left out 1 problem(s) of {path} whose prompt does not fit max_seq_len={limit}; the first: "
        f"{path}:5: prompt of {limit} tokens leaves no room for a sampled token within max_seq_len={limit} "
        "(batcher.max_seq_len)"
    ]
    assert make_environment(config, tok, seed=0).data_report()["skipped_long_prompts"] == 0  # no limit given
    config.args["max_seq_len"] = 6  # an explicit arg wins over the run's
    assert make_environment(config, tok, seed=0, max_seq_len=limit).data_report()["skipped_long_prompts"] == 3


# ---- the driver's check before anything starts ---------------------------------------------------------------------


def _run_yaml(tmp_path, data_path: str, **args) -> str:
    """experiments/quickstart.yaml with a math environment on `data_path` (GSM8K format) instead of addition."""
    cfg = yaml.safe_load((ROOT / "experiments" / "quickstart.yaml").read_text())
    cfg["output_dir"] = str(tmp_path / "run")
    cfg["envs"] = [
        {"name": "math", "env_class": "marin_rl.envs.math:MathEnvironment", "args": {"train_path": data_path, **args}}
    ]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


def test_driver_check_reports_counts_and_refuses_bad_data(tmp_path):
    good = write_lines(tmp_path / "good.jsonl", [json.dumps(r) for r in GOOD])
    config = parse_config(["--config", _run_yaml(tmp_path, good)])
    assert check_environment_data(config) == {
        "data/math/train_problems": 4.0,
        "data/math/eval_problems": 1.0,
        "data/math/skipped_malformed_rows": 0.0,
        "data/math/skipped_long_prompts": 0.0,
    }
    long_question = {"question": "y" * config.batcher.max_seq_len, "answer": "#### 1"}
    bad = jsonl_with(tmp_path / "bad.jsonl", json.dumps(long_question))
    config = parse_config(["--config", _run_yaml(tmp_path, bad)])
    with pytest.raises(RunRefused, match=rf"^invalid data: {bad}:4: prompt of \d+ tokens .* max_seq_len=64"):
        check_environment_data(config)
    config = parse_config(["--config", _run_yaml(tmp_path, bad, skip_bad_rows=True)])
    assert check_environment_data(config)["data/math/skipped_long_prompts"] == 1.0
    # an argument the class does not take, or a bad value of one it declares, is refused as the config is read
    with pytest.raises(
        SystemExit, match=r"^marin_rl: invalid configuration: envs\[math\]\.args do not fit .*'no_such_arg'$"
    ):
        parse_config(["--config", _run_yaml(tmp_path, bad, no_such_arg=1)])
    with pytest.raises(
        SystemExit, match=r"^marin_rl: invalid configuration: envs\[math\]\.args\.format: must be one of"
    ):
        parse_config(["--config", _run_yaml(tmp_path, bad, format="csv")])


@pytest.mark.exclusive  # the refusal's wall-clock bound
def test_bad_data_stops_the_command_with_one_line_before_ray_starts(tmp_path):
    """The whole command line (`parse_config`, then `run`): the data is loaded in the driver and the run is refused
    with one line before Ray, a server or the learner starts."""
    import ray

    from marin_rl.run import main

    path = jsonl_with(tmp_path / "train.jsonl", '{"question": 42, "answer": "#### 1"}')
    start = time.time()
    with pytest.raises(SystemExit) as exit_:
        main(["--config", _run_yaml(tmp_path, path)])
    elapsed = time.time() - start
    assert str(exit_.value.code) == f"marin_rl: invalid data: {path}:4: field 'question': expected a string, got int 42"
    assert elapsed < 15, elapsed
    assert not ray.is_initialized()
    assert not (tmp_path / "run" / "config.yaml").exists(), "a refused run leaves nothing to resume"
