"""The quickstart task: integer addition, rewarded for the exact answer."""

from __future__ import annotations

import itertools
import random

from marin_rl.envs.base import Problem, SingleTurnEnvironment


class AdditionEnvironment(SingleTurnEnvironment):
    """'a+b=' → the decimal sum. Reward 1 for the exact answer, 0 otherwise.

    All pairs with operands in [0, max_operand] are shuffled with `seed`; the first `num_eval` are held out for
    evaluation and never trained on.

    `demo_error_rate` makes `reference_completion` an unreliable demonstrator: with that probability it slips by
    ±1 or ±10 (a dropped or spurious carry). A warm start on such demonstrations yields a policy that knows
    addition but often answers wrongly, the situation RL post-training is for; the reward is exact correctness.
    """

    name = "addition"

    def __init__(
        self,
        tokenizer,
        *,
        name: str | None = None,
        seed: int = 0,
        reward_weights: dict[str, float] | None = None,
        max_operand: int = 99,
        num_eval: int = 200,
        demo_error_rate: float = 0.0,
    ):
        super().__init__(tokenizer, name=name, seed=seed, reward_weights=reward_weights)
        if max_operand < 1:
            raise ValueError("max_operand must be >= 1")
        if not 0.0 <= demo_error_rate < 1.0:
            raise ValueError("demo_error_rate must be in [0, 1)")
        pairs = list(itertools.product(range(max_operand + 1), repeat=2))
        if not 0 < num_eval < len(pairs):
            raise ValueError(f"num_eval must be in (0, {len(pairs)}) for max_operand={max_operand}")
        random.Random(seed).shuffle(pairs)
        make = lambda a, b: Problem(id=f"{a}+{b}", prompt=f"{a}+{b}=", answer=str(a + b), fields={"a": a, "b": b})
        self._eval = [make(a, b) for a, b in pairs[:num_eval]]
        self._train = [make(a, b) for a, b in pairs[num_eval:]]
        self.max_operand = max_operand
        self.demo_error_rate = demo_error_rate
        self._demo_rng = random.Random(seed + 1)

    def train_problems(self) -> list[Problem]:
        return self._train

    def eval_problems(self) -> list[Problem]:
        return self._eval

    def reference_completion(self, problem: Problem) -> str:
        if self._demo_rng.random() < self.demo_error_rate:
            answer = int(problem.answer)
            slips = [answer + d for d in (-10, -1, 1, 10) if answer + d >= 0]
            return str(self._demo_rng.choice(slips))
        return problem.answer

    def score(self, problem: Problem, completion: str) -> dict[str, float]:
        return {"correct": float(completion.strip() == problem.answer)}
