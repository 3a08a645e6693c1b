"""Math (GSM8K-style) and multiple-choice environments: data loading, verifiers, and episodes on the embedded server."""

import asyncio
import dataclasses
import json

import equinox as eqx
import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from marin_rl.config import EnvConfig, make_environment
from marin_rl.envs.base import SamplingParams, run_groups
from marin_rl.envs.data import DataFormatError, load_gsm8k, load_qa, parse_gsm8k_answer, read_rows
from marin_rl.envs.math import MathEnvironment, answers_match, extract_answer, verify
from marin_rl.envs.multiple_choice import MultipleChoiceEnvironment, extract_choice
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.model.build import build_model
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.tokenizer import build_char_tokenizer

GSM8K_ROWS = [
    {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2+3=<<2+3=5>>5\n#### 5"},
    {"question": "A car costs 1,200 dollars. Two cars?", "answer": "1200*2=2400\n#### 2,400"},
    {"question": "Half of 1?", "answer": "1/2=0.5\n#### 0.5"},
    {"question": "5 minus 8?", "answer": "#### -3"},
    {"question": "7 times 6?", "answer": "6*7=42 #### 42"},
]
MC_ROWS = [
    {"question": "2+2?", "choices": ["3", "4", "5"], "answer": 1},
    {"question": "Sky color?", "choices": ["blue", "red"], "answer": "A"},
    {"question": "Largest?", "choices": ["1", "9", "5", "2"], "answer": "b"},
    {"id": "q-cap", "question": "Capital of France?", "choices": ["Rome", "Paris", "Oslo"], "answer": "(B)"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def tok():
    return build_char_tokenizer()


# ---- data loading ------------------------------------------------------------------------------------


def test_gsm8k_loader_jsonl_and_parquet(tmp_path):
    jsonl = write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    parquet = tmp_path / "test-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), parquet)  # the Hugging Face layout of GSM8K
    for path in (jsonl, str(parquet)):
        problems = load_gsm8k(path, prompt_template="Q: {question}\nA:")
        assert [p.answer for p in problems] == ["5", "2400", "0.5", "-3", "42"]
        assert problems[1].prompt == "Q: A car costs 1,200 dollars. Two cars?\nA:"
        assert problems[0].fields == {"question": GSM8K_ROWS[0]["question"], "solution": GSM8K_ROWS[0]["answer"]}
        assert len({p.id for p in problems}) == len(problems)
    assert load_gsm8k(jsonl)[0].id == "train-0"
    assert [p.answer for p in load_gsm8k(str(tmp_path / "*.jsonl"))] == ["5", "2400", "0.5", "-3", "42"]  # globs


def test_generic_qa_loader_with_custom_fields(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"id": 7, "problem": "1+1", "solution": 2, "level": "easy"}])
    [p] = load_qa(path, question_field="problem", answer_field="solution", prompt_template="{level}: {question}=")
    assert (p.id, p.prompt, p.answer) == ("7", "easy: 1+1=", "2")


def test_loader_errors_name_file_and_field(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [GSM8K_ROWS[0], {"question": "no answer here"}])
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:2: field 'answer': missing"):
        load_gsm8k(path)
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:1: field 'problem': missing"):
        load_qa(path, question_field="problem")
    pq.write_table(pa.Table.from_pylist([{"q": "x", "answer": "#### 1"}]), tmp_path / "bad.parquet")
    with pytest.raises(DataFormatError, match=r"bad\.parquet:row 0: field 'question': missing"):
        load_gsm8k(str(tmp_path / "bad.parquet"))
    no_sep = write_jsonl(tmp_path / "nosep.jsonl", [{"question": "q", "answer": "42"}])
    with pytest.raises(DataFormatError, match=r"nosep\.jsonl:1: field 'answer': GSM8K answer has no '####'"):
        load_gsm8k(no_sep)
    (tmp_path / "broken.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{not json\n')
    with pytest.raises(DataFormatError, match=r"broken\.jsonl:2: invalid JSON"):
        read_rows(str(tmp_path / "broken.jsonl"))
    with pytest.raises(DataFormatError, match=r"missing\.jsonl: no such file"):
        read_rows(str(tmp_path / "missing.jsonl"))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataFormatError, match=r"data\.csv: unknown file type"):
        read_rows(str(tmp_path / "data.csv"))


def test_parse_gsm8k_answer_strips_commas():
    assert parse_gsm8k_answer("so 1,234,567 total\n#### 1,234,567") == "1234567"
    assert parse_gsm8k_answer("a #### 1 #### 3") == "3"


# ---- math verifier -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, reference",
    [
        (" 42", "42"),
        ("0.5", "1/2"),
        ("1/2", "0.5"),
        ("\\frac{1}{2}", "0.5"),
        ("The answer is \\boxed{\\dfrac{1}{2}}.", "0.5"),
        ("1,000", "1000"),
        ("It costs 1,000 dollars.", "1000"),
        ("#### 2,400", "2400"),
        ("first 3 then #### -3", "-3"),
        ("x is -3", "-3"),
        ("42.", "42"),
        ("42.0", "42"),
        ("\\boxed{18 \\text{ dollars}}", "18"),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
        ("\\boxed{9} but earlier 7", "9"),
        ("#### 72\nthen 5 more tokens", "72"),
        ("\\boxed{x + 1}", "x+1"),
        ("\\boxed{\\frac{1}{2}", "0.5"),  # unclosed box: falls back to the last number, \\frac{1}{2}
    ],
)
def test_verifier_accepts_equivalent_answers(completion, reference):
    assert verify(completion, reference) == 1.0


@pytest.mark.parametrize(
    "completion, reference",
    [
        ("", "5"),
        ("   ", "5"),
        ("no digits at all", "5"),
        ("41", "42"),
        ("3", "-3"),
        ("0.333", "1/3"),
        ("1,0000", "10000"),  # malformed grouping: the last number read is 0
        ("\\boxed{", "5"),
        ("\\boxed{}", "5"),
        ("\\frac{1}{0}", "1"),
        ("1/0", "1"),
        ("\\boxed{9**9**9**9}", "1"),
        ("\\boxed{__import__('os').system('false')}", "0"),
        ("\\boxed{" + "1+" * 500 + "1}", "501"),
        ("\x00\xff\ud7ff", "0"),
    ],
)
def test_verifier_rejects_wrong_or_malformed_answers(completion, reference):
    assert verify(completion, reference) == 0.0


def test_extract_answer_priorities():
    assert extract_answer("3 then \\boxed{4} then 5") == "4"
    assert extract_answer("3 #### 4 and 5") == "4 and 5"
    assert extract_answer("3, then -1.5 and 7/8") == "7/8"
    assert extract_answer("") is None
    assert extract_answer("none") is None
    assert not answers_match(None, "1")


# ---- multiple choice ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        (" B", "B"),
        ("(B)", "B"),
        ("B.", "B"),
        ("B) because", "B"),
        ("Answer: B", "B"),
        ("The answer is C", "C"),
        ("I think D", "D"),  # 'I' is beyond the 4 options
        ("BAD", None),
        ("answer b", None),
        ("", None),
        ("E", None),
        ("A or B", "A"),
    ],
)
def test_extract_choice(completion, expected):
    assert extract_choice(completion, 4) == expected


def test_multiple_choice_prompt_answers_and_errors(tok, tmp_path):
    path = write_jsonl(tmp_path / "mc.jsonl", MC_ROWS)
    env = MultipleChoiceEnvironment(tok, path=path, eval_problems=[MC_ROWS[0]])
    assert [p.answer for p in env.train_problems()] == ["B", "A", "B", "B"]
    assert env.train_problems()[0].prompt == "Question: 2+2?\nA. 3\nB. 4\nC. 5\nAnswer:"
    assert env.train_problems()[3].id == "q-cap"
    p = env.train_problems()[0]
    assert env.score(p, " (B) 4")["correct"] == 1.0
    assert env.score(p, "Answer: A")["correct"] == 0.0
    assert env.score(p, "")["correct"] == 0.0
    assert env.score(p, env.reference_completion(p))["correct"] == 1.0

    pq.write_table(pa.Table.from_pylist(MC_ROWS[1:]), tmp_path / "mc.parquet")  # letter answers, some ids null
    env = MultipleChoiceEnvironment(tok, path=str(tmp_path / "mc.parquet"), eval_fraction=0.34, seed=1)
    assert len(env.train_problems()) == 2 and len(env.eval_problems()) == 1
    assert {p.id for p in env.train_problems()}.isdisjoint(p.id for p in env.eval_problems())

    bad = write_jsonl(tmp_path / "mcbad.jsonl", [{"question": "q", "answer": 0}])
    with pytest.raises(DataFormatError, match=r"mcbad\.jsonl:1: field 'choices': missing"):
        MultipleChoiceEnvironment(tok, path=bad)
    with pytest.raises(DataFormatError, match=r"problems\[0\]: field 'answer': 3 is not one of the 2 options"):
        MultipleChoiceEnvironment(tok, problems=[{"question": "q", "choices": ["x", "y"], "answer": 3}] * 2)
    with pytest.raises(DataFormatError, match="expected a list of 2 to 26 options"):
        MultipleChoiceEnvironment(tok, problems=[{"question": "q", "choices": "xy", "answer": 0}] * 2)
    with pytest.raises(ValueError, match="exactly one of `path` and `problems`"):
        MultipleChoiceEnvironment(tok)


def test_math_env_split_and_reference(tok, tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", GSM8K_ROWS)
    a = MathEnvironment(tok, train_path=path, eval_fraction=0.4, seed=3)
    b = MathEnvironment(tok, train_path=path, eval_fraction=0.4, seed=3)
    assert [p.id for p in a.eval_problems()] == [p.id for p in b.eval_problems()]
    assert len(a.eval_problems()) == 2 and len(a.train_problems()) == 3
    assert {p.id for p in a.train_problems()}.isdisjoint(p.id for p in a.eval_problems())
    for p in a.train_problems() + a.eval_problems():
        assert p.prompt.startswith("Question: ") and p.prompt.endswith("\nAnswer:")
        assert a.score(p, a.reference_completion(p)) == {"correct": 1.0}
    with pytest.raises(ValueError, match="format: must be one of"):
        MathEnvironment(tok, train_path=path, format="csv")
    with pytest.raises(DataFormatError, match="duplicate problem id"):
        MathEnvironment(tok, train_path=path, eval_path=path)


def test_make_environment_builds_both_envs(tok, tmp_path):
    gsm = write_jsonl(tmp_path / "gsm.jsonl", GSM8K_ROWS)
    qa = write_jsonl(tmp_path / "qa.jsonl", [{"q": "1+1", "a": 2}])
    qa_eval = write_jsonl(tmp_path / "qa_eval.jsonl", [{"q": "1+1", "a": 2}, {"q": "2+2", "a": 4}])
    math_env = make_environment(
        EnvConfig(name="gsm8k", env_class="marin_rl.envs.math:MathEnvironment", args={"train_path": gsm}), tok, 0
    )
    assert isinstance(math_env, MathEnvironment) and math_env.name == "gsm8k"
    assert len(math_env.train_problems()) + len(math_env.eval_problems()) == len(GSM8K_ROWS)
    qa_env = make_environment(
        EnvConfig(
            name="qa",
            env_class="marin_rl.envs.math:MathEnvironment",
            args={
                "train_path": qa,
                "eval_path": qa_eval,
                "format": "jsonl",
                "question_field": "q",
                "answer_field": "a",
            },
        ),
        tok,
        0,
    )
    assert [p.answer for p in qa_env.eval_problems()] == ["2", "4"]
    mc_env = make_environment(
        EnvConfig(
            name="mc",
            env_class="marin_rl.envs.multiple_choice:MultipleChoiceEnvironment",
            args={"problems": MC_ROWS, "eval_fraction": 0.25},
        ),
        tok,
        0,
    )
    assert isinstance(mc_env, MultipleChoiceEnvironment) and mc_env.name == "mc"
    with pytest.raises(ValueError, match=r"envs\[mc\]\.args do not fit"):
        make_environment(
            EnvConfig(name="mc", env_class="marin_rl.envs.multiple_choice:MultipleChoiceEnvironment", args={"x": 1}),
            tok,
            0,
        )


# ---- episodes on the embedded server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    tok = build_char_tokenizer()
    arch = dataclasses.replace(tiny_llama(), max_seq_len=128)
    model = build_model(ModelConfig(architecture=arch), len(tok))
    srv = LevanterInferenceServer(
        model,
        tok,
        InferenceConfig(max_seqs=32, max_seq_len=128, levanter=LevanterServerConfig(page_size=16, prefill_tokens=512)),
    )
    srv.apply_weights(0, [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))])
    address = srv.start()
    yield tok, address
    srv.stop()


def _run_groups(env, address, problems, n, sampling):
    return asyncio.run(run_groups(env, [address], problems, n, sampling))


def test_episodes_on_embedded_server(server, tmp_path):
    tok, address = server
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [{"question": f"{i}+1?", "answer": f"#### {i + 1}"} for i in range(6)])
    math_env = MathEnvironment(tok, train_path=gsm, eval_fraction=0.5)
    mc_env = MultipleChoiceEnvironment(tok, path=write_jsonl(tmp_path / "mc.jsonl", MC_ROWS), eval_fraction=0.25)
    sampling = SamplingParams(temperature=1.0, max_tokens=8)
    for env, verifier in (
        (math_env, lambda p, text: verify(text, p.answer)),
        (mc_env, lambda p, text: float(extract_choice(text, len(p.fields["choices"])) == p.answer)),
    ):
        problems = env.train_problems()[:3]
        groups = _run_groups(env, address, problems, 4, sampling)
        for problem, group in zip(problems, groups, strict=True):
            assert group.environment == env.name and group.problem_id == problem.id
            assert len(group.rollouts) == 4
            for r in group.rollouts:
                r.validate(len(tok))
                prompt, sampled = r.turns
                assert prompt.token_ids == env.encode_prompt(problem) and not prompt.is_sampled
                assert 1 <= len(sampled.token_ids) <= sampling.max_tokens
                text = tok.decode(sampled.token_ids, skip_special_tokens=True)
                assert sampled.message == text
                assert r.reward in (0.0, 1.0)
                assert r.reward == verifier(problem, text) == sampled.rewards["correct"]
                mask = r.loss_mask()
                assert mask.tolist() == [False] * len(prompt.token_ids) + [True] * len(sampled.token_ids)


def test_reward_weights_from_the_config_args_replace_the_environment_s_own(tok, tmp_path):
    """Named rewards are weighted in one place: the environment (its class default, or `reward_weights` in its
    config `args`); the replay buffer uses the turn reward it is given."""
    from marin_rl.inference.client import Sample

    class Exact:
        async def sample(self, prompt_ids, *, n, **kwargs):
            text = f" {problem.answer}"
            ids = tok(text, add_special_tokens=False)["input_ids"]
            return [Sample(ids, [-0.1] * len(ids), text, "stop", 0, 0, "local", 0.0)] * n

    cfg = EnvConfig(
        name="addition",
        env_class="marin_rl.envs.arithmetic:AdditionEnvironment",
        args={"max_operand": 9, "num_eval": 10, "reward_weights": {"correct": 2.5}},
    )
    env = make_environment(cfg, tok, seed=0)
    problem = env.train_problems()[0]
    group = asyncio.run(env.run_group(Exact(), problem, 2, SamplingParams(max_tokens=4)))
    assert [r.turns[-1].rewards for r in group.rollouts] == [{"correct": 1.0}] * 2
    assert [r.reward for r in group.rollouts] == [2.5, 2.5]
    with pytest.raises(ValueError, match=r"reward_weights\['correct'\] must be a finite number"):
        make_environment(
            dataclasses.replace(cfg, args={**cfg.args, "reward_weights": {"correct": float("inf")}}), tok, seed=0
        )
