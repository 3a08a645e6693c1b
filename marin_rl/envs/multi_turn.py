"""Multi-turn episodes: a conversation that keeps messages and exact token ids, and an environment built on it.

Token ids
---------
A `Conversation`'s ids are built once and only ever appended to:

* the initial prompt: the messages rendered with the tokenizer's chat template and the generation prompt
  (`apply_chat_template(messages, tools=..., add_generation_prompt=True, tokenize=True)`);
* a policy turn: exactly the ids the server returned (its stop token included), never re-tokenized;
* an environment turn (tool results, user replies): the ids of its *rendered delta*. The template is rendered for
  a fixed anchor conversation `[user, assistant(MARK)]` without the generation prompt, and for the same anchor
  followed by the new messages with the generation prompt. The text after MARK in the second rendering is the
  delta: what closes an assistant turn (e.g. '<eos>', or '<|im_end|>\\n' in ChatML), the new messages, and the next
  generation prompt. It is tokenized on its own. The closing tokens that the policy already sampled as its stop
  token (the longest prefix of the closing ids that ends the policy turn) are dropped from it; a policy turn that
  did not sample them (cut off by a token limit) gets them at the start of the environment turn, untrained.

Assumptions, checked where possible: the template renders a message the same whatever follows it (checked on
the anchor, with a clear error), and the delta starts at a token boundary, so tokenizing it alone gives the ids
that tokenizing the whole conversation would give there. Templates that delimit messages with special tokens
(ChatML/Qwen, Llama 3, the character tokenizer's) satisfy this: the delta starts with the end-of-turn token.
Since the anchor's content is a fixed marker, the real history is never re-rendered, and templates that rewrite
earlier assistant turns (e.g. drop their reasoning) cannot change the ids already sent.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from marin_rl.bounds import bounded
from marin_rl.envs.base import (  # the chat-template helpers are re-exported here, where they are documented
    _ANCHOR,
    ChatTemplateError,
    Environment,
    Problem,
    SamplingParams,
    _after_mark,
    _encode,
    _render,
    add_prompt_routing,
    policy_turn,
)
from marin_rl.envs.rewards import (
    RewardFunction,
    aevaluate_rewards,
    combine_rewards,
)
from marin_rl.inference.chat import end_of_turn_ids
from marin_rl.inference.client import PolicyClient, Sample
from marin_rl.types import ROLES, Rollout, Turn

ENV_ROLES = tuple(r for r in ROLES if r != "assistant")


def rendered_delta(tokenizer, messages: list[dict]) -> tuple[list[int], int]:
    """Token ids that follow an assistant turn when `messages` are added, up to the next generation prompt.

    Returns `(ids, n_close)`: the delta's ids (closing of the assistant turn, the messages, the generation prompt)
    and how many of its leading ids are the assistant turn's closing. See the module docstring for the method.
    """
    head, close = _after_mark(_render(tokenizer, _ANCHOR, add_generation_prompt=False), "anchor")
    full = _render(tokenizer, _ANCHOR + list(messages), add_generation_prompt=True)
    full_head, suffix = _after_mark(full, "anchor followed by new messages")
    if full_head != head:
        raise ChatTemplateError(
            "the chat template renders a conversation's start differently once more messages follow; "
            "token-exact deltas are not possible with it"
        )
    if not suffix.startswith(close):
        close = ""  # the template closes the assistant turn differently when more follows: nothing to match
    ids = _encode(tokenizer, suffix)
    close_ids = _encode(tokenizer, close)
    n_close = len(close_ids) if ids[: len(close_ids)] == close_ids else 0
    return ids, n_close


def _closing_overlap(sampled: list[int], delta: list[int], n_close: int) -> int:
    """How many leading closing ids of `delta` the sampled turn already ends with (its sampled stop token)."""
    for k in range(min(n_close, len(sampled)), 0, -1):
        if sampled[-k:] == delta[:k]:
            return k
    return 0


def _check_messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError(f"{where}: expected a non-empty list of messages, got {messages!r}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise ValueError(f"{where}[{i}]: a message is a dict with 'role' in {ROLES} and str 'content', got {m!r}")
        out.append(dict(m))
    return out


class Conversation:
    """Messages of one episode together with their exact token ids, as a list of `Turn`s.

    The first turn is the rendered prompt; then policy turns (`add_policy_turn`, the server's ids) alternate with
    environment turns (`add_messages`, the rendered delta of one or more messages). `token_ids` is always the
    next prompt to send to the server.
    """

    def __init__(
        self,
        tokenizer,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        stop_token_ids: list[int] | None = None,
    ):
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.messages: list[dict] = _check_messages(messages, "initial messages")
        ids = tokenizer.apply_chat_template(self.messages, tools=self.tools, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        self.turns: list[Turn] = [
            Turn(
                role=self.messages[-1]["role"],
                message="\n\n".join(m["content"] for m in self.messages),
                token_ids=[int(t) for t in ids],
            )
        ]
        self.stop_token_ids: list[int] = list(stop_token_ids) if stop_token_ids else end_of_turn_ids(tokenizer)
        """Token ids that end a policy turn (EOS and the template's end-of-turn token, unless given)."""

    # ---- views ------------------------------------------------------------------------------------------
    @property
    def prompt_ids(self) -> list[int]:
        """Ids of the initial prompt."""
        return self.turns[0].token_ids

    @property
    def token_ids(self) -> list[int]:
        """All ids so far: the prompt of the next policy turn."""
        return [t for turn in self.turns for t in turn.token_ids]

    @property
    def num_tokens(self) -> int:
        """Length of `token_ids`."""
        return sum(len(t.token_ids) for t in self.turns)

    @property
    def policy_turns(self) -> list[Turn]:
        """The sampled turns, in order."""
        return [t for t in self.turns if t.is_sampled]

    @property
    def last_policy_turn(self) -> Turn | None:
        """The latest sampled turn, or None before the first one."""
        turns = self.policy_turns
        return turns[-1] if turns else None

    # ---- appending --------------------------------------------------------------------------------------
    def add_policy_turn(self, sample: Sample, sampling: SamplingParams) -> Turn:
        """Append a policy turn with exactly the sampled ids; its message is their text as the server decoded it
        (special tokens skipped)."""
        if self.turns[-1].is_sampled:
            raise ValueError("two policy turns in a row: add the environment's messages in between")
        text = sample.text
        add_prompt_routing(self.turns, sample)
        turn = policy_turn(sample, text, sampling)
        self.turns.append(turn)
        self.messages.append({"role": "assistant", "content": text})
        return turn

    def env_turn_ids(self, messages: list[dict]) -> list[int]:
        """Ids that `add_messages(messages)` would append (the rendered delta, minus the already sampled closing)."""
        messages = _check_messages(messages, "environment messages")
        if not self.turns[-1].is_sampled:
            raise ValueError("environment messages must follow a policy turn")
        ids, n_close = rendered_delta(self.tokenizer, messages)
        return ids[_closing_overlap(self.turns[-1].token_ids, ids, n_close) :]

    def add_messages(self, messages: list[dict], token_ids: list[int] | None = None) -> Turn:
        """Append environment messages (one turn; `token_ids` defaults to `env_turn_ids(messages)`)."""
        messages = _check_messages(messages, "environment messages")
        bad = [m["role"] for m in messages if m["role"] not in ENV_ROLES]
        if bad:
            raise ValueError(f"environment messages may have roles {ENV_ROLES}, got {bad}")
        ids = self.env_turn_ids(messages) if token_ids is None else list(token_ids)
        roles = {m["role"] for m in messages}
        turn = Turn(
            role=messages[0]["role"] if len(roles) == 1 else "user",
            message="\n".join(m["content"] for m in messages),
            token_ids=ids,
        )
        self.turns.append(turn)
        self.messages.extend(messages)
        return turn


class EnvResponse(NamedTuple):
    """What an environment answers to a policy turn."""

    messages: list[dict] | None
    """Messages to show the policy next (e.g. tool results, a user reply), or None to end the episode."""
    rewards: dict[str, float]
    """Named rewards for the policy turn just taken (may be empty)."""


class MultiTurnEnvironment(Environment):
    """An episode of several policy turns; subclasses write only `env_response` (and the problems).

    The loop: render the prompt (`initial_messages`), sample a policy turn, ask `env_response` for the next
    messages and the turn's named rewards, append them as an environment turn, repeat until `env_response` returns
    no messages. `episode_rewards` then scores the whole episode (its named rewards go on the last policy turn).
    Every turn's `reward` is its named rewards combined with `reward_weights`; the rollout's reward is their sum.

    Limits end an episode cleanly, with `rollout.metadata['truncated'] = True` and `['truncation_reason']`:
    `max_turns` policy turns ('max_turns'), and `max_episode_tokens` tokens in the whole conversation
    ('token_limit': each policy turn's `max_tokens` is cut to what is left, and environment messages that would
    leave no room for another policy token are not added). Keep `max_episode_tokens` at most the inference
    server's `max_seq_len` and the batcher's `max_seq_len`.
    """

    reward_functions: dict[str, RewardFunction] = {}

    @dataclass
    class Args(Environment.Args):
        max_turns: int = bounded(4, ge=1)
        """Policy turns after which an episode ends, truncated."""
        max_episode_tokens: int | None = bounded(None, ge=2)
        """Tokens of the whole conversation after which an episode ends, truncated (None: no limit)."""
        system_prompt: str | None = None
        """The system message that opens each episode (None: none)."""
        stop_token_ids: list[int] | None = None
        """Token ids that end a policy turn (None: EOS and the chat template's end-of-turn token)."""

    args: Args

    def __init__(self, tokenizer, **args):
        super().__init__(tokenizer, **args)
        self.max_turns = self.args.max_turns
        self.max_episode_tokens = self.args.max_episode_tokens
        self.system_prompt = self.args.system_prompt
        self.stop_token_ids = self.args.stop_token_ids

    # ---- hooks for environment authors ------------------------------------------------------------------
    def initial_messages(self, problem: Problem) -> list[dict]:
        """The messages that open an episode: `system_prompt` (if set) and the problem's prompt as the user."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": problem.prompt}]

    def tools_for_prompt(self) -> list[dict] | None:
        """Tool schemas (OpenAI format) passed to the chat template, or None."""
        return None

    @abc.abstractmethod
    async def env_response(self, problem: Problem, conversation: Conversation) -> EnvResponse:
        """React to the policy turn that `conversation` ends with.

        Return `(messages, rewards)`: the messages to add (role 'user', 'tool' or 'system'), or None to end the
        episode, and named rewards for that policy turn. Returning messages after `max_turns` policy turns ends
        the episode as truncated.
        """

    async def episode_rewards(self, problem: Problem, conversation: Conversation) -> dict[str, float]:
        """Named rewards of the whole episode (added to the last policy turn).

        By default, `reward_functions` evaluated with the initial prompt as `prompt` and the last policy turn as
        `completion` (functions may also declare a `conversation` keyword); no rewards if none are set.
        """
        if not self.reward_functions:
            return {}
        last = conversation.last_policy_turn
        fields = {"answer": problem.answer, **problem.fields, "conversation": conversation}
        return await aevaluate_rewards(
            self.reward_functions,
            conversation.turns[0].message,
            last.message,
            list(conversation.prompt_ids),
            list(last.token_ids),
            fields,
        )

    async def episode_added_rewards(self, problem: Problem, conversation: Conversation) -> dict[str, float]:
        """The added reward functions (`add_reward_functions`, e.g. a reward model's) on the whole episode: `prompt`
        and `prompt_ids` are the rendered prompt, `completion` and `completion_ids` everything after it (policy and
        environment turns, exact ids)."""
        if not self.added_rewards:
            return {}
        rest = conversation.turns[1:]
        return await self.added_reward_values(
            problem,
            conversation.turns[0].message,
            "".join(self.tokenizer.decode(t.token_ids, skip_special_tokens=False) for t in rest),
            list(conversation.prompt_ids),
            [i for t in rest for i in t.token_ids],
        )

    def reference_messages(self, problem: Problem) -> list[dict] | None:
        """A correct continuation of the prompt for warm start: assistant and environment messages, or None."""
        return None

    # ---- machinery ---------------------------------------------------------------------------------------
    def new_conversation(self, problem: Problem) -> Conversation:
        """A conversation holding the problem's rendered prompt."""
        return Conversation(
            self.tokenizer,
            self.initial_messages(problem),
            tools=self.tools_for_prompt(),
            stop_token_ids=self.stop_token_ids,
        )

    def encode_prompt(self, problem: Problem) -> list[int]:
        """Token ids of the rendered initial prompt (ending with the generation prompt)."""
        return self.new_conversation(problem).prompt_ids

    def reference_completion(self, problem: Problem) -> str | None:
        """`reference_messages` as the text that follows the prompt, built with the same ids an episode would
        have: assistant contents each closed by the stop token, environment messages as rendered deltas. The last
        assistant message is left open (warm start appends EOS)."""
        messages = self.reference_messages(problem)
        if not messages:
            return None
        messages = _check_messages(messages, f"{self.name}: reference_messages")
        if messages[0]["role"] != "assistant" or messages[-1]["role"] != "assistant":
            raise ValueError(f"{self.name}: reference_messages must start and end with an assistant message")
        stop = self.new_conversation(problem).stop_token_ids[:1]  # what a policy turn ends with when it stops
        ids: list[int] = []
        i = 0
        while i < len(messages):
            if messages[i]["role"] == "assistant":
                if i and messages[i - 1]["role"] == "assistant":
                    raise ValueError(f"{self.name}: reference_messages has two assistant messages in a row")
                ids += _encode(self.tokenizer, messages[i]["content"]) + (stop if i < len(messages) - 1 else [])
                i += 1
                continue
            j = i
            while messages[j]["role"] != "assistant":
                j += 1
            delta, n_close = rendered_delta(self.tokenizer, messages[i:j])
            ids += delta[_closing_overlap(ids, delta, n_close) :]
            i = j
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _credit(self, turn: Turn, rewards: Mapping[str, float], where: str) -> None:
        for k, v in (rewards or {}).items():
            v = float(v)
            if not math.isfinite(v):
                raise ValueError(f"{self.name}: {where} gave a non-finite reward {k}={v}")
            turn.rewards[k] = turn.rewards.get(k, 0.0) + v
        turn.reward = combine_rewards(turn.rewards, self.reward_weights)

    async def run_episode(self, policy: PolicyClient, problem: Problem, sampling: SamplingParams) -> Rollout:
        """Alternate policy turns and `env_response` until the env ends the episode or a limit is reached."""
        conv = self.new_conversation(problem)
        limit = self.max_episode_tokens
        if limit is not None and conv.num_tokens >= limit:
            raise ValueError(
                f"{self.name}: problem {problem.id} has a prompt of {conv.num_tokens} tokens, "
                f"at least max_episode_tokens={limit}"
            )
        reason: str | None = None
        while True:
            turn_sampling = sampling
            if limit is not None and limit - conv.num_tokens < sampling.max_tokens:
                turn_sampling = dataclasses.replace(sampling, max_tokens=limit - conv.num_tokens)
            [sample] = await policy.sample(
                conv.token_ids,
                n=1,
                max_tokens=turn_sampling.max_tokens,
                temperature=turn_sampling.temperature,
                stop_token_ids=conv.stop_token_ids,
            )
            turn = conv.add_policy_turn(sample, turn_sampling)
            messages, rewards = await self.env_response(problem, conv)
            self._credit(turn, rewards, "env_response")
            if messages is None:
                break
            if len(conv.policy_turns) >= self.max_turns:
                reason = "max_turns"
                break
            ids = conv.env_turn_ids(messages)
            if limit is not None and conv.num_tokens + len(ids) >= limit:
                reason = "token_limit"
                break
            conv.add_messages(messages, ids)
        final = await self.episode_rewards(problem, conv)
        added = await self.episode_added_rewards(problem, conv)
        clash = sorted(set(final) & set(added))
        if clash:
            raise ValueError(f"{self.name}: rewards {clash} are both scored by episode_rewards and added")
        final = {**final, **added}
        self._credit(conv.last_policy_turn, final, "episode_rewards")
        return Rollout(
            environment=self.name,
            problem_id=problem.id,
            turns=conv.turns,
            metadata={
                "answer": problem.answer,
                "truncated": reason is not None,
                "truncation_reason": reason,
                "policy_turns": len(conv.policy_turns),
                "episode_rewards": {k: float(v) for k, v in final.items()},
            },
        )
