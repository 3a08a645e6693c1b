"""A task with long completions: count on from a number, rewarded per number.

'count 37:' → ' 38 39 40 … 77' (`length` numbers; about 3 tokens each with the character tokenizer, so 40 numbers
are ~130 sampled tokens). The reward is the fraction of the `length` positions that hold the right number, so every
slip costs a little and the reward is dense enough to learn from in a few minutes. This is the setting where
generation dominates a step and asynchrony between generation and training should pay
(`benchmarks/staleness.py`).
"""

from __future__ import annotations

import random

from marin_rl.envs.base import Problem, SingleTurnEnvironment


class CountingEnvironment(SingleTurnEnvironment):
    """'count a:' → the `length` numbers after a, space separated. Reward 'correct': the fraction of positions with
    the right number (extra numbers are ignored, missing ones count as wrong).

    Starting numbers are drawn from [0, max_start] and shuffled with `seed`; `num_eval` are held out. With
    `demo_error_rate`, each number of a reference completion slips (±1, ±10, or a digit dropped) with that
    probability, so a policy warm-started on the demonstrations miscounts now and then and RL has something to fix.
    """

    name = "counting"

    def __init__(
        self,
        tokenizer,
        *,
        length: int = 40,
        max_start: int = 899,
        num_eval: int = 100,
        demo_error_rate: float = 0.0,
        **options,
    ):
        super().__init__(tokenizer, **options)
        if length < 1 or max_start < 1:
            raise ValueError("length and max_start must be >= 1")
        if not 0 < num_eval <= max_start:
            raise ValueError(f"num_eval must be in (0, {max_start}]")
        if not 0.0 <= demo_error_rate < 1.0:
            raise ValueError("demo_error_rate must be in [0, 1)")
        starts = list(range(max_start + 1))
        random.Random(self.seed).shuffle(starts)
        self.length = length
        make = lambda a: Problem(id=str(a), prompt=f"count {a}:", answer=self._count(a), fields={"start": a})
        self._eval = [make(a) for a in starts[:num_eval]]
        self._train = [make(a) for a in starts[num_eval:]]
        self.demo_error_rate = demo_error_rate
        self._demo_rng = random.Random(self.seed + 1)

    def _count(self, start: int) -> str:
        return " " + " ".join(str(start + i) for i in range(1, self.length + 1))

    def train_problems(self) -> list[Problem]:
        return self._train

    def eval_problems(self) -> list[Problem]:
        return self._eval

    def reference_completion(self, problem: Problem) -> str:
        numbers = problem.answer.split()
        for i, n in enumerate(numbers):
            if self._demo_rng.random() < self.demo_error_rate:
                value = int(n)
                slips = [str(value + d) for d in (-10, -1, 1, 10) if value + d >= 0]
                if len(n) > 1:
                    slips.append(n[:-1])  # a digit dropped
                numbers[i] = self._demo_rng.choice(slips)
        return " " + " ".join(numbers)

    def score(self, problem: Problem, completion: str) -> dict[str, float]:
        want, got = problem.answer.split(), completion.split()
        return {"correct": sum(a == b for a, b in zip(want, got, strict=False)) / len(want)}
