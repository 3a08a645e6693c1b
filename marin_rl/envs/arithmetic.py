"""The quickstart task: integer addition, rewarded for the exact answer."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from marin_rl.bounds import bounded
from marin_rl.envs.base import Problem, SingleTurnEnvironment


class AdditionEnvironment(SingleTurnEnvironment):
    """'a+b=' → the decimal sum. Reward 1 for the exact answer, 0 otherwise.

    All pairs with operands in [0, max_operand] are shuffled with `seed`; the first `num_eval` are held out for
    evaluation and never trained on.

    `demo_error_rate` makes `reference_completion` an unreliable demonstrator: with that probability it slips by
    ±1 or ±10 (a dropped or spurious carry). A warm start on such demonstrations yields a policy that knows
    addition but often answers wrongly, the situation RL post-training is for; the reward is exact correctness.

    `worked=True` asks for the work before the answer, column by column from the ones, then the sum after the last
    ';': '23+48=' -> '3+8=11;2+4+1=7;71' (a column's '+1' is the carry into it). Completions are several times
    longer while the reward still judges only the final sum (`final_sum`), which is where a per-token signal and a
    per-episode reward differ most. A demonstrator's slip is then a column whose sum is off by one, carried through
    consistently to the answer it writes.
    """

    name = "addition"

    @dataclass
    class Args(SingleTurnEnvironment.Args):
        max_operand: int = bounded(99, ge=1)
        """Largest operand: problems are all pairs in [0, max_operand]."""
        num_eval: int = bounded(200, gt=0)
        """Pairs held out for evaluation (fewer than all pairs)."""
        demo_error_rate: float = bounded(0.0, ge=0, lt=1)
        """Probability that a reference completion slips (by ±1 or ±10; worked: a column off by one)."""
        worked: bool = False
        """Ask for the work, column by column, before the sum (see the class docstring)."""

        def __post_init__(self):
            super().__post_init__()
            pairs = (self.max_operand + 1) ** 2
            if self.num_eval >= pairs:
                raise ValueError(f"num_eval: must be in (0, {pairs}) for max_operand={self.max_operand}")

    args: Args

    def __init__(self, tokenizer, **args):
        super().__init__(tokenizer, **args)
        pairs = list(itertools.product(range(self.args.max_operand + 1), repeat=2))
        random.Random(self.seed).shuffle(pairs)
        make = lambda a, b: Problem(id=f"{a}+{b}", prompt=f"{a}+{b}=", answer=str(a + b), fields={"a": a, "b": b})
        self._eval = [make(a, b) for a, b in pairs[: self.args.num_eval]]
        self._train = [make(a, b) for a, b in pairs[self.args.num_eval :]]
        self._demo_rng = random.Random(self.seed + 1)

    def train_problems(self) -> list[Problem]:
        return self._train

    def eval_problems(self) -> list[Problem]:
        return self._eval

    def reference_completion(self, problem: Problem) -> str:
        if self.args.worked:
            a, b = problem.fields["a"], problem.fields["b"]
            columns = max(len(str(a)), len(str(b)))
            slip = None
            if self._demo_rng.random() < self.args.demo_error_rate:
                slip = (self._demo_rng.randrange(columns), self._demo_rng.choice((-1, 1)))
            return worked_sum(a, b, slip)
        if self._demo_rng.random() < self.args.demo_error_rate:
            answer = int(problem.answer)
            slips = [answer + d for d in (-10, -1, 1, 10) if answer + d >= 0]
            return str(self._demo_rng.choice(slips))
        return problem.answer

    def score(self, problem: Problem, completion: str) -> dict[str, float]:
        answer = final_sum(completion) if self.args.worked else completion.strip()
        return {"correct": float(answer == problem.answer)}


def worked_sum(a: int, b: int, slip: tuple[int, int] | None = None) -> str:
    """The worked addition of `a` and `b` (`AdditionEnvironment(worked=True)`): one 'x+y[+1]=s' per column from the
    ones, ';'-separated, then the sum. `slip` = (column, ±1) writes that column's sum off by one and carries the
    error on consistently (the demonstrator's mistake); a slip below 0 writes 0 instead."""
    da, db = str(a)[::-1], str(b)[::-1]
    steps, digits, carry = [], [], 0
    for i in range(max(len(da), len(db))):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        total = x + y + carry + (slip[1] if slip is not None and slip[0] == i else 0)
        total = max(total, 0)
        steps.append(f"{x}+{y}{'+1' if carry else ''}={total}")
        digits.append(str(total % 10))
        carry = total // 10
    answer = (str(carry) if carry else "") + "".join(reversed(digits))
    return ";".join([*steps, str(int(answer))])


def final_sum(completion: str) -> str:
    """The answer of a worked completion: the text after its last ';', stripped ('' without one)."""
    _, sep, tail = completion.rpartition(";")
    return tail.strip() if sep else ""
