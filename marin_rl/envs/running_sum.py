"""A small multi-turn task with a reward per turn: add one more number to the running total, several times.

The user opens with 'a+b=', the assistant answers; the user then adds a number to the correct total so far
('s+c=', so a wrong turn does not doom the next), and so on for `num_terms - 1` policy turns. Each turn earns
'correct' = 1 for the exact total of that turn: the per-turn rewards that per-token credit (GAE) can use and a group
baseline spreads over the whole episode.
"""

from __future__ import annotations

import random

from marin_rl.envs.base import Problem
from marin_rl.envs.multi_turn import Conversation, EnvResponse, MultiTurnEnvironment


class RunningSumEnvironment(MultiTurnEnvironment):
    """`num_terms` numbers in [0, max_term] per problem; `num_terms - 1` policy turns, each rewarded on its own.

    `demo_error_rate`: the warm-start demonstrations slip by ±1 in a turn with this probability (an unreliable
    demonstrator, as in the quickstart). `num_eval` problems are held out."""

    name = "running_sum"
    reward_weights = {"correct": 1.0}

    def __init__(
        self,
        tokenizer,
        *,
        num_terms: int = 4,
        max_term: int = 9,
        num_train: int = 4000,
        num_eval: int = 100,
        demo_error_rate: float = 0.0,
        **kwargs,
    ):
        kwargs.setdefault("max_turns", num_terms - 1)
        super().__init__(tokenizer, **kwargs)
        if num_terms < 2 or max_term < 1 or num_train < 1 or num_eval < 1:
            raise ValueError("num_terms must be >= 2 and max_term, num_train, num_eval >= 1")
        if not 0.0 <= demo_error_rate < 1.0:
            raise ValueError("demo_error_rate must be in [0, 1)")
        rng = random.Random(self.seed)
        seen: set[tuple[int, ...]] = set()
        problems = []
        while len(problems) < num_train + num_eval:
            terms = tuple(rng.randint(0, max_term) for _ in range(num_terms))
            if terms in seen and len(seen) < (max_term + 1) ** num_terms:
                continue
            seen.add(terms)
            totals = [sum(terms[: i + 1]) for i in range(1, num_terms)]
            fields = {"terms": list(terms), "totals": totals}
            problems.append(Problem("+".join(map(str, terms)), f"{terms[0]}+{terms[1]}=", str(totals[-1]), fields))
        self._eval, self._train = problems[:num_eval], problems[num_eval:]
        self.demo_error_rate = demo_error_rate
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
            slip = self._demo_rng.random() < self.demo_error_rate
            messages.append(
                {
                    "role": "assistant",
                    "content": str(max(0, total + self._demo_rng.choice((-1, 1)))) if slip else str(total),
                }
            )
            if i + 1 < len(totals):
                messages.append({"role": "user", "content": f"{total}+{terms[i + 2]}="})
        return messages
