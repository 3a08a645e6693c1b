"""A small multi-turn task with a reward per turn: add one more number to the running total, several times.

The user opens with 'a+b=', the assistant answers; the user then adds a number to the correct total so far
('s+c=', so a wrong turn does not doom the next), and so on for `num_terms - 1` policy turns. Each turn earns
'correct' = 1 for the exact total of that turn: the per-turn rewards that per-token credit (GAE) can use and a group
baseline spreads over the whole episode.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from marin_rl.bounds import bounded
from marin_rl.envs.base import Problem
from marin_rl.envs.multi_turn import Conversation, EnvResponse, MultiTurnEnvironment


class RunningSumEnvironment(MultiTurnEnvironment):
    """`num_terms` numbers in [0, max_term] per problem; `num_terms - 1` policy turns, each rewarded on its own.

    `demo_error_rate`: the warm-start demonstrations slip by ±1 in a turn with this probability (an unreliable
    demonstrator, as in the quickstart). `num_eval` problems are held out."""

    name = "running_sum"
    reward_weights = {"correct": 1.0}

    @dataclass
    class Args(MultiTurnEnvironment.Args):
        max_turns: int | None = bounded(None, ge=1)
        """Policy turns after which an episode ends, truncated (None: `num_terms - 1`, the whole task)."""

        num_terms: int = bounded(4, ge=2)
        """Numbers per problem (`num_terms - 1` policy turns)."""
        max_term: int = bounded(9, ge=1)
        """Largest number: terms are drawn from [0, max_term]."""
        num_train: int = bounded(4000, ge=1)
        """Training problems."""
        num_eval: int = bounded(100, ge=1)
        """Held-out problems."""
        demo_error_rate: float = bounded(0.0, ge=0, lt=1)
        """Probability that a demonstration turn slips by ±1."""

        def __post_init__(self):
            if self.max_turns is None and isinstance(self.num_terms, int):
                self.max_turns = self.num_terms - 1
            super().__post_init__()

    args: Args

    def __init__(self, tokenizer, **args):
        super().__init__(tokenizer, **args)
        num_terms, max_term = self.args.num_terms, self.args.max_term
        rng = random.Random(self.seed)
        seen: set[tuple[int, ...]] = set()
        problems = []
        while len(problems) < self.args.num_train + self.args.num_eval:
            terms = tuple(rng.randint(0, max_term) for _ in range(num_terms))
            if terms in seen and len(seen) < (max_term + 1) ** num_terms:
                continue
            seen.add(terms)
            totals = [sum(terms[: i + 1]) for i in range(1, num_terms)]
            fields = {"terms": list(terms), "totals": totals}
            problems.append(Problem("+".join(map(str, terms)), f"{terms[0]}+{terms[1]}=", str(totals[-1]), fields))
        self._eval, self._train = problems[: self.args.num_eval], problems[self.args.num_eval :]
        self._demo_rng = random.Random(self.seed + 1)

    def train_problems(self) -> list[Problem]:
        return self._train

    def eval_problems(self) -> list[Problem]:
        return self._eval

    async def env_response(self, problem: Problem, conversation: Conversation) -> EnvResponse:
        turn = len(conversation.policy_turns)  # 1-based index of the turn just taken
        totals, terms = problem.fields["totals"], problem.fields["terms"]
        said = conversation.last_policy_turn.message.strip()
        rewards = {"correct": float(said == str(totals[turn - 1]))}
        if turn == len(totals):
            return EnvResponse(None, rewards)
        return EnvResponse([{"role": "user", "content": f"{totals[turn - 1]}+{terms[turn + 1]}="}], rewards)

    def reference_messages(self, problem: Problem) -> list[dict]:
        totals, terms = problem.fields["totals"], problem.fields["terms"]
        messages = []
        for i, total in enumerate(totals):
            slip = self._demo_rng.random() < self.args.demo_error_rate
            messages.append(
                {
                    "role": "assistant",
                    "content": str(max(0, total + self._demo_rng.choice((-1, 1)))) if slip else str(total),
                }
            )
            if i + 1 < len(totals):
                messages.append({"role": "user", "content": f"{total}+{terms[i + 2]}="})
        return messages
