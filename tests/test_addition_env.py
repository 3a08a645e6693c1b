"""The addition task's worked format: the work is right column by column, the reward judges only the final sum, and
the unreliable demonstrator's slips are consistent mistakes that move the answer by 1 or 10."""

import re

import pytest

from marin_rl.envs.arithmetic import AdditionEnvironment, final_sum, worked_sum
from marin_rl.tokenizer import build_char_tokenizer

STEP = re.compile(r"^(\d)\+(\d)(\+1)?=(\d+)$")


def check_work(a: int, b: int, text: str) -> tuple[int, list[int]]:
    """Re-derive `text` step by step from the operands' digits (independently of `worked_sum`): every column names
    the right digits and the carry the previous column wrote, and the answer is what the columns' sums imply.
    Returns that answer and the columns whose sum is not the digits plus the carry (the slips)."""
    *steps, answer = text.split(";")
    da, db = str(a)[::-1], str(b)[::-1]
    carry, digits, off = 0, [], []
    for i, step in enumerate(steps):
        x, y, plus_one, total = STEP.match(step).groups()
        assert int(x) == (int(da[i]) if i < len(da) else 0) and int(y) == (int(db[i]) if i < len(db) else 0)
        assert bool(plus_one) == bool(carry), (text, i)
        if int(total) != int(x) + int(y) + carry:
            off.append(i)
        digits.append(int(total) % 10)
        carry = int(total) // 10
    implied = carry * 10 ** len(digits) + sum(d * 10**i for i, d in enumerate(digits))
    assert int(answer) == implied, text
    return implied, off


def test_the_worked_sum_of_every_pair_is_right_column_by_column():
    for a in range(100):
        for b in range(100):
            text = worked_sum(a, b)
            assert check_work(a, b, text) == (a + b, []) and final_sum(text) == str(a + b), text
    assert worked_sum(23, 48) == "3+8=11;2+4+1=7;71"
    assert worked_sum(5, 37) == "5+7=12;0+3+1=4;42"


def test_a_slip_is_carried_through_consistently_and_moves_the_answer_by_one_or_ten():
    assert worked_sum(23, 48, (0, 1)) == "3+8=12;2+4+1=7;72"
    assert worked_sum(23, 48, (1, -1)) == "3+8=11;2+4+1=6;61"
    for a, b in ((23, 48), (9, 9), (40, 60), (17, 5)):
        for column in range(max(len(str(a)), len(str(b)))):
            for d in (-1, 1):
                text = worked_sum(a, b, (column, d))
                answer, off = check_work(a, b, text)
                if answer == a + b:  # only a column sum of 0 cannot slip lower
                    assert d == -1 and off == [] and text == worked_sum(a, b), text
                else:
                    assert answer - (a + b) == d * 10**column and off == [column], text


@pytest.mark.parametrize(
    "completion, reward",
    [("3+8=11;2+4+1=7;71", 1.0), ("3+8=11;2+4=6;71", 1.0), ("3+8=11;2+4+1=7;72", 0.0), ("71", 0.0), ("", 0.0)],
)
def test_the_worked_reward_judges_only_the_final_sum(completion, reward):
    env = AdditionEnvironment(build_char_tokenizer(), max_operand=49, worked=True)
    problem = next(p for p in env.train_problems() + env.eval_problems() if p.id == "23+48")
    assert env.score(problem, completion) == {"correct": reward}
    plain = AdditionEnvironment(build_char_tokenizer(), max_operand=49)
    assert plain.score(problem, "71") == {"correct": 1.0}


def test_the_worked_demonstrator_slips_at_its_rate():
    env = AdditionEnvironment(build_char_tokenizer(), max_operand=49, worked=True, demo_error_rate=0.4)
    problems = env.train_problems()[:2000]
    wrong = 0
    for p in problems:
        text = env.reference_completion(p)
        answer, off = check_work(p.fields["a"], p.fields["b"], text)  # a slip is still consistent work
        assert len(off) <= 1 and (answer == int(p.answer)) == (not off) and final_sum(text) == str(answer)
        wrong += bool(off)
    assert 0.33 < wrong / len(problems) < 0.42  # 0.4, less the slips below a column sum of 0
