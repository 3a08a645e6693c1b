"""A task with long completions: count on from a number, rewarded per number.

'count 37:' → ' 38 39 40 … 77' (`length` numbers; about 3 tokens each with the character tokenizer, so 40 numbers
are ~130 sampled tokens). The reward is the fraction of the `length` positions that hold the right number, so every
slip costs a little and the reward is dense enough to learn from in a few minutes. This is the setting where
generation dominates a step and asynchrony between generation and training should pay
(`benchmarks/staleness.py`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from marin_rl.bounds import bounded
from marin_rl.envs.base import Problem, SingleTurnEnvironment


class CountingEnvironment(SingleTurnEnvironment):
    """'count a:' → the `length` numbers after a, space separated. Reward 'correct': the fraction of positions with
    the right number (extra numbers are ignored, missing ones count as wrong).

    Starting numbers are drawn from [0, max_start] and shuffled with `seed`; `num_eval` are held out. With
    `demo_error_rate`, each number of a reference completion slips (±1, ±10, or a digit dropped) with that
    probability, so a policy warm-started on the demonstrations miscounts now and then and RL has something to fix.
    """

    name = "counting"

    @dataclass
    class Args(SingleTurnEnvironment.Args):
        length: int = bounded(40, ge=1)
        """Numbers to count on from the start."""
        max_start: int = bounded(899, ge=1)
        """Largest starting number: starts are drawn from [0, max_start]."""
        num_eval: int = bounded(100, gt=0)
        """Starting numbers held out for evaluation (at most max_start)."""
        demo_error_rate: float = bounded(0.0, ge=0, lt=1)
        """Probability that a number of a reference completion slips (±1, ±10, or a digit dropped)."""

        def __post_init__(self):
            super().__post_init__()
            if self.num_eval > self.max_start:
                raise ValueError(f"num_eval: must be in (0, {self.max_start}] for max_start={self.max_start}")

    args: Args

    def __init__(self, tokenizer, **args):
        super().__init__(tokenizer, **args)
        starts = list(range(self.args.max_start + 1))
        random.Random(self.seed).shuffle(starts)
        make = lambda a: Problem(id=str(a), prompt=f"count {a}:", answer=self._count(a), fields={"start": a})
        self._eval = [make(a) for a in starts[: self.args.num_eval]]
        self._train = [make(a) for a in starts[self.args.num_eval :]]
        self._demo_rng = random.Random(self.seed + 1)

    def _count(self, start: int) -> str:
        return " " + " ".join(str(start + i) for i in range(1, self.args.length + 1))

    def train_problems(self) -> list[Problem]:
        return self._train

    def eval_problems(self) -> list[Problem]:
        return self._eval

    def reference_completion(self, problem: Problem) -> str:
        numbers = problem.answer.split()
        for i, n in enumerate(numbers):
            if self._demo_rng.random() < self.args.demo_error_rate:
                value = int(n)
                slips = [str(value + d) for d in (-10, -1, 1, 10) if value + d >= 0]
                if len(n) > 1:
                    slips.append(n[:-1])  # a digit dropped
                numbers[i] = self._demo_rng.choice(slips)
        return " " + " ".join(numbers)

    def score(self, problem: Problem, completion: str) -> dict[str, float]:
        want, got = problem.answer.split(), completion.split()
        return {"correct": sum(a == b for a, b in zip(want, got, strict=False)) / len(want)}
