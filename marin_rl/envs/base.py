"""The environment API: problems, a verifier, and an async episode function that talks to the policy."""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import importlib
import inspect
import time
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from marin_rl.bounds import bounded, field_errors
from marin_rl.envs.rewards import (
    RewardFunction,
    aevaluate_rewards,
    check_reward_weights,
    combine_rewards,
    evaluate_rewards,
)
from marin_rl.inference.client import PolicyClient, Sample
from marin_rl.types import InferenceMetadata, Rollout, RolloutGroup, Turn


@dataclass
class Problem:
    """One task instance."""

    id: str
    """Stable identifier, unique within the environment."""
    prompt: str
    """Text shown to the policy."""
    answer: str
    """Reference answer used by the verifier (and as the warm-start completion)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Extra, environment-specific data."""
    source: str = ""
    """Where the problem was read ('train.jsonl:17', 'train.parquet:row 3', 'problems[2]'), for messages; empty for
    generated problems."""


@dataclass
class SamplingParams:
    """How the policy samples in an environment."""

    temperature: float = bounded(1.0, gt=0)
    """Sampling temperature (the learner uses the same one to compute logprobs, dividing the logits by it: > 0)."""
    max_tokens: int = bounded(16, ge=1)
    """Limit on generated tokens per policy turn."""


PROMPT_CACHE_SIZE = 1 << 16
"""Distinct prompts whose token ids an environment keeps (`SingleTurnEnvironment.encode_prompt`)."""


# ---- chat-template helpers (the method is described in `marin_rl.envs.multi_turn`) -------------------------
_ANCHOR_MARK = "MARINRLANCHOR7F3A"
_ANCHOR = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _ANCHOR_MARK}]


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used for token-exact multi-turn episodes (the message says why)."""


def _render(tokenizer, messages: list[dict], *, add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError(f"tokenizer {type(tokenizer).__name__} has no chat template")
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _after_mark(text: str, what: str) -> tuple[str, str]:
    at = text.find(_ANCHOR_MARK)
    if at < 0:
        raise ChatTemplateError(f"the chat template drops assistant content ({what}); cannot locate turn boundaries")
    return text[: at + len(_ANCHOR_MARK)], text[at + len(_ANCHOR_MARK) :]


def assistant_close_text(tokenizer) -> str:
    """The text the chat template puts after an assistant message's content (e.g. '<eos>', '<|im_end|>\\n')."""
    _, close = _after_mark(_render(tokenizer, _ANCHOR, add_generation_prompt=False), "anchor")
    return close


def inherit_keyword_parameters(cls: type) -> None:
    """When `cls` defines a constructor ending in `**options` (passed on to its base class's constructor), give that
    constructor the signature that names them: its own parameters, then the base constructor's keyword-only ones it
    does not name itself (and the base's `**options` only if the base takes any). `inspect.signature(cls)` then
    binds exactly the arguments the chain accepts."""
    init = cls.__dict__.get("__init__")
    if init is None:
        return
    own = list(inspect.signature(init).parameters.values())
    if not own or own[-1].kind is not inspect.Parameter.VAR_KEYWORD:
        return
    base = next(k.__dict__["__init__"] for k in cls.__mro__[1:] if "__init__" in k.__dict__)
    names = {p.name for p in own}
    inherited = [
        p
        for p in inspect.signature(base).parameters.values()
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD) and p.name not in names
    ]
    init.__signature__ = inspect.Signature([*own[:-1], *inherited], return_annotation=inspect.Signature.empty)


@dataclass
class EnvArgs:
    """The arguments every environment takes. A built-in environment declares its own as a dataclass `Args`
    nested in its class, inheriting its base class's `Args` (each field with a docstring; cross-field checks in
    `__post_init__`, after `super().__post_init__()`, raising ValueError that starts with the field's name).

    The environment's constructor builds `self.args` from its keyword arguments (an env's `args` in the config,
    plus `name` and `seed` the run sets); `marin_rl.config` builds the same dataclass when it checks a config, so
    an unknown name or a bad value is refused in one line before anything starts."""

    name: str | None = None
    """The environment's name (set by the run from `envs[*].name`; None: the class's `name`)."""
    seed: int = 0
    """Seed of the environment's problem generation and sampling (set by the run from `orchestrator.seed`)."""
    reward_weights: dict[str, float] | None = None
    """Weights of the named rewards in a turn's reward (None: the class's `reward_weights`)."""

    def __post_init__(self):
        problems = field_errors(self)  # int and float fields: type, finiteness, declared `bounded` ranges
        try:
            hints = typing.get_type_hints(type(self))
        except Exception:  # annotations that do not resolve here: only the numeric checks
            hints = {}
        for f in dataclasses.fields(self):
            kind, value = hints.get(f.name), getattr(self, f.name)
            if kind in (str, bool) and not isinstance(value, kind):
                problems.append(f"{f.name}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
        if problems:
            raise ValueError(problems[0])


def declare_args(cls: type) -> None:
    """Give the constructor of `cls`, a class that declares `Args`, the signature of those arguments:
    `(self, tokenizer, *, <Args fields>)` (what `inspect.signature(cls)` and the config check see). The constructor
    must be `__init__(self, tokenizer, **args)`, passing `args` on to its base class's."""
    if not (isinstance(cls.__dict__["Args"], type) and issubclass(cls.Args, EnvArgs)):
        raise TypeError(f"{cls.__name__}.Args must be a dataclass inheriting EnvArgs")
    if not dataclasses.is_dataclass(cls.Args) or "__dataclass_fields__" not in cls.Args.__dict__:
        raise TypeError(f"{cls.__name__}.Args must be decorated with @dataclass")
    init = cls.__dict__.get("__init__")
    params = list(inspect.signature(init).parameters.values()) if init is not None else []
    if [p.kind for p in params] != [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 2 + [inspect.Parameter.VAR_KEYWORD]:
        raise TypeError(f"{cls.__name__} declares Args: its constructor must be __init__(self, tokenizer, **args)")

    def default(f: dataclasses.Field) -> Any:
        if f.default is not dataclasses.MISSING:
            return f.default
        return inspect.Parameter.empty if f.default_factory is dataclasses.MISSING else f.default_factory()

    keywords = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default(f), annotation=f.type)
        for f in dataclasses.fields(cls.Args)
        if f.init
    ]
    init.__signature__ = inspect.Signature([*params[:2], *keywords])
    init.__env_args__ = cls.Args


def args_class(cls: type) -> type[EnvArgs] | None:
    """The `Args` dataclass that takes all of the constructor arguments of `cls` (None when its constructor is a
    plain signature, e.g. a user-written environment's `__init__(self, tokenizer, *, ..., **options)`)."""
    args = getattr(cls.__init__, "__env_args__", None)
    return args if args is not None and args is getattr(cls, "Args", None) else None


class Environment(abc.ABC):
    """A task: training and held-out problems, and an episode that turns a problem into a scored `Rollout`.

    Subclasses take the tokenizer and their own keyword arguments (from the env's `args` in the config), declared
    one of two ways. The built-in environments declare them once as a dataclass `Args` nested in the class (see
    `EnvArgs`), with a constructor `__init__(self, tokenizer, **args)` that passes them on: the base builds
    `self.args` (checked) from them. Or a plain constructor names them, ending in `**options` passed on to its base
    class's: its signature (what `marin_rl.config` checks an env's `args` against) then names the base's keyword
    arguments too (`inherit_keyword_parameters`), so an unknown one is still refused before anything starts.
    `reward_weights` (a class attribute, or the `reward_weights` argument, which replaces it) combines a turn's
    named rewards into its reward: Σ weight · named reward, names without a weight counting 0.

    `add_reward_functions` adds named reward functions from outside the environment (e.g. a reward model's,
    `marin_rl.envs.model_rewards`): they are evaluated beside the environment's own rewards (single-turn: on each
    completion; multi-turn: on the whole episode at its end) and weighted by `reward_weights` like them.

    A subclass whose constructor takes a `max_seq_len` keyword gets the run's `batcher.max_seq_len` there (unless
    its `args` set one; `marin_rl.config.make_environment`), to refuse problems that cannot fit when it loads them.
    `data_report` tells the run what was loaded (and skipped): the driver records it as `data/<env>/<key>` in the
    metrics at step 0 and in the summary.
    """

    name: str = "env"
    reward_weights: dict[str, float] = {"correct": 1.0}
    driver_check: bool = False
    """Whether the run's driver builds this environment once before it starts anything, so that bad data stops the
    run before Ray or any actor starts (`marin_rl.orchestrator.preflight`). For classes whose construction only
    reads data; not for those that start processes or open connections."""
    needs_sandbox: bool = False
    """Whether the environment runs tools in sandboxes (`marin_rl.envs.sandbox`): the driver then checks that this
    machine can make one before it starts anything, and refuses the run in one line naming what is missing."""
    added_rewards: dict[str, RewardFunction] = {}
    """Reward functions added with `add_reward_functions` (by name)."""

    Args: ClassVar[type[EnvArgs]] = EnvArgs
    """The dataclass of the constructor's arguments (`self.args`), for classes that declare theirs as one."""
    args: EnvArgs
    """This environment's arguments, checked: `Args` built from the constructor's keyword arguments."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "Args" in cls.__dict__:
            declare_args(cls)
        else:
            inherit_keyword_parameters(cls)

    def __init__(self, tokenizer, **args):
        self.tokenizer = tokenizer
        self.args = type(self).Args(**args)
        self.seed = self.args.seed
        if self.args.name is not None:
            self.name = self.args.name
        if self.args.reward_weights is not None:
            self.reward_weights = dict(self.args.reward_weights)
        check_reward_weights(self.reward_weights, where=self.name)

    def add_reward_functions(self, functions: dict[str, RewardFunction]) -> None:
        """Evaluate `functions` (reward functions, sync or async, by name) beside the environment's own rewards from
        now on. Raises ValueError for a name already in use."""
        own = set(getattr(self, "reward_functions", {}) or {})
        taken = sorted((set(functions) & own) | (set(functions) & set(self.added_rewards)))
        if taken:
            raise ValueError(f"{self.name}: rewards {taken} are already computed by the environment or added before")
        self.added_rewards = {**self.added_rewards, **functions}

    def verifier_weights(self) -> dict[str, float]:
        """The environment's own verifier as weights over its named rewards: the class's `reward_weights` (what the
        environment scores by itself), without the added rewards and the zero weights. A run that trains on a
        reward model (`reward_weights: {correct: 0.0, rm: 1.0}`) still measures its policy with these; empty for a
        class that defines no verifier of its own."""
        return {k: w for k, w in type(self).reward_weights.items() if w and k not in self.added_rewards}

    async def added_reward_values(
        self, problem: Problem, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int]
    ) -> dict[str, float]:
        """The added reward functions' values for one completion (empty when none were added)."""
        if not self.added_rewards:
            return {}
        fields = {"answer": problem.answer, **problem.fields}
        return await aevaluate_rewards(self.added_rewards, prompt, completion, prompt_ids, completion_ids, fields)

    @abc.abstractmethod
    def train_problems(self) -> list[Problem]:
        """Problems to train on."""

    @abc.abstractmethod
    def eval_problems(self) -> list[Problem]:
        """Held-out problems (disjoint from the training ones)."""

    @abc.abstractmethod
    async def run_episode(self, policy: PolicyClient, problem: Problem, sampling: SamplingParams) -> Rollout:
        """Play one episode of `problem` with `policy` and return the scored rollout."""

    def reference_completion(self, problem: Problem) -> str | None:
        """A correct completion for supervised warm start, or None if the env has none."""
        return None

    def data_report(self) -> dict[str, int]:
        """Counts about the loaded problems (`train_problems`, `eval_problems`; environments that read data files
        add the rows they skipped), as the run records them."""
        return {"train_problems": len(self.train_problems()), "eval_problems": len(self.eval_problems())}

    async def run_group(
        self, policy: PolicyClient, problem: Problem, group_size: int, sampling: SamplingParams
    ) -> RolloutGroup:
        """`group_size` concurrent episodes of one problem."""
        rollouts = await asyncio.gather(*(self.run_episode(policy, problem, sampling) for _ in range(group_size)))
        return RolloutGroup(environment=self.name, problem_id=problem.id, rollouts=list(rollouts))


declare_args(Environment)


class SingleTurnEnvironment(Environment):
    """Prompt → one sampled completion → verifier.

    Subclasses implement the problems and either `score` or `reward_functions` (named rule-based reward functions,
    see `marin_rl.envs.rewards`); the named rewards are combined with `reward_weights` into the turn's reward.

    The prompt is the problem's text as it is, and the policy's turn ends at EOS; after `use_chat_template` (an env's
    `chat_template: true` in the config) it is the tokenizer's chat template rendering of a user message (after an
    optional system message) with the generation prompt, and the turn ends at the template's end-of-turn token
    (e.g. <|im_end|>) or EOS.
    """

    reward_functions: dict[str, RewardFunction] = {}
    chat: bool = False
    """Whether prompts are rendered with the tokenizer's chat template (`use_chat_template`)."""
    system_prompt: str | None = None
    """The system message of a chat-rendered prompt (None: none)."""

    def use_chat_template(self, system_prompt: str | None = None) -> None:
        """Render prompts with the tokenizer's chat template from now on: `system_prompt` (if given) and the
        problem's prompt as the user message, then the generation prompt. Raises ValueError when the tokenizer has
        no chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.name}: chat_template is set, but the tokenizer has no chat template")
        self.chat, self.system_prompt = True, system_prompt
        self.__dict__.pop("_prompt_ids", None)
        self.__dict__.pop("_stop_token_ids", None)

    def prompt_messages(self, problem: Problem) -> list[dict]:
        """The chat messages of a problem's prompt (when rendered with the chat template)."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": problem.prompt}]

    def encode_prompt(self, problem: Problem) -> list[int]:
        """Token ids of the prompt: its text (no special tokens added) or, with the chat template, the rendered
        messages and generation prompt. Each distinct prompt is tokenized once per environment."""
        cache = self.__dict__.setdefault("_prompt_ids", {})
        ids = cache.get(problem.prompt)
        if ids is None:
            if self.chat:
                rendered = self.tokenizer.apply_chat_template(
                    self.prompt_messages(problem), add_generation_prompt=True, tokenize=True
                )
                ids = tuple(int(t) for t in getattr(rendered, "input_ids", rendered))
            else:
                ids = tuple(self.tokenizer(problem.prompt, add_special_tokens=False)["input_ids"])
            if len(cache) < PROMPT_CACHE_SIZE:
                cache[problem.prompt] = ids
        return list(ids)

    @property
    def stop_token_ids(self) -> list[int]:
        """Token ids that end the policy's turn: EOS; with the chat template, the template's end-of-turn token first
        (when it is a special token other than EOS, e.g. <|im_end|> of a tokenizer whose EOS is <|endoftext|>)."""
        stops = self.__dict__.get("_stop_token_ids")
        if stops is None:
            eos = self.tokenizer.eos_token_id
            stops = [] if eos is None else [int(eos)]
            if self.chat:
                close = self.tokenizer(assistant_close_text(self.tokenizer), add_special_tokens=False)["input_ids"]
                if close and close[0] in set(self.tokenizer.all_special_ids):
                    stops = [int(close[0])] + [t for t in stops if t != close[0]]
            self.__dict__["_stop_token_ids"] = stops
        return list(stops)

    def score(self, problem: Problem, completion: str) -> dict[str, float]:
        """Named rewards of a completion; combined with `reward_weights` into the turn's reward.

        Override this, or set `reward_functions` (then `rewards` evaluates those instead).
        """
        raise NotImplementedError(f"{type(self).__name__} must override `score` or set `reward_functions`")

    def _reward_function_args(
        self, problem: Problem, prompt_ids: list[int], completion: str, completion_ids: list[int]
    ) -> tuple:
        """The arguments of `evaluate_rewards` / `aevaluate_rewards` for this completion, after checking that every
        named reward (own and added) has a weight."""
        check_reward_weights(self.reward_weights, [*self.reward_functions, *self.added_rewards], self.name)
        fields = {"answer": problem.answer, **problem.fields}
        return self.reward_functions, problem.prompt, completion, list(prompt_ids), list(completion_ids), fields

    def rewards(
        self, problem: Problem, prompt_ids: list[int], completion: str, completion_ids: list[int]
    ) -> dict[str, float]:
        """The environment's own named rewards of a sampled completion: `reward_functions` if any are set (all
        sync), else `score`. Added reward functions are not evaluated here (see `arewards`)."""
        if self.reward_functions:
            return evaluate_rewards(*self._reward_function_args(problem, prompt_ids, completion, completion_ids))
        return self.score(problem, completion)

    async def arewards(
        self, problem: Problem, prompt_ids: list[int], completion: str, completion_ids: list[int]
    ) -> dict[str, float]:
        """All named rewards of a sampled completion: the environment's own (`reward_functions`, async ones awaited,
        or `score`) and the added reward functions'."""
        if self.reward_functions:
            own = await aevaluate_rewards(*self._reward_function_args(problem, prompt_ids, completion, completion_ids))
        else:
            own = self.score(problem, completion)
        added = await self.added_reward_values(
            problem, problem.prompt, completion, list(prompt_ids), list(completion_ids)
        )
        clash = sorted(set(own) & set(added))
        if clash:
            raise ValueError(f"{self.name}: rewards {clash} are both scored by the environment and added")
        return {**own, **added}

    async def run_episode(self, policy: PolicyClient, problem: Problem, sampling: SamplingParams) -> Rollout:
        [rollout] = await self._sample_rollouts(policy, problem, 1, sampling)
        return rollout

    async def run_group(
        self, policy: PolicyClient, problem: Problem, group_size: int, sampling: SamplingParams
    ) -> RolloutGroup:
        """All `group_size` completions in one request (`n=group_size`)."""
        rollouts = await self._sample_rollouts(policy, problem, group_size, sampling)
        return RolloutGroup(environment=self.name, problem_id=problem.id, rollouts=rollouts)

    async def _sample_rollouts(
        self, policy: PolicyClient, problem: Problem, n: int, sampling: SamplingParams
    ) -> list[Rollout]:
        prompt_ids = self.encode_prompt(problem)
        samples = await policy.sample(
            prompt_ids,
            n=n,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            stop_token_ids=self.stop_token_ids or None,
        )
        completions = [s.text for s in samples]  # the server's decoding of the sampled ids (special tokens skipped)
        # concurrently: a reward model's client sends the group's completions in one request
        scored = await asyncio.gather(
            *(self.arewards(problem, prompt_ids, c, s.token_ids) for c, s in zip(completions, samples, strict=True))
        )
        rollouts = []
        for sample, completion, rewards in zip(samples, completions, scored, strict=True):
            reward = combine_rewards(rewards, self.reward_weights)
            turns = [Turn(role="user", message=problem.prompt, token_ids=list(prompt_ids))]
            add_prompt_routing(turns, sample)
            turns.append(policy_turn(sample, completion, sampling, reward=reward, rewards=rewards))
            rollouts.append(
                Rollout(environment=self.name, problem_id=problem.id, turns=turns, metadata={"answer": problem.answer})
            )
        return rollouts


def add_prompt_routing(turns: list[Turn], sample: Sample) -> None:
    """Give `turns` (the conversation before a policy turn: their tokens, concatenated, were `sample`'s prompt) the
    sampler's routing of their tokens (`Sample.routed_experts`, routing replay): to those that have none, and to the
    tokens of the others that have none recorded (an earlier policy turn's last token, first fed in this prompt);
    nothing when the sample carries none. Routing recorded earlier stands (it produced that turn's logprobs)."""
    routes = sample.routed_experts
    if routes is None:
        return
    start = 0
    for turn in turns:
        end = start + len(turn.token_ids)
        if turn.routed_experts is None:
            turn.routed_experts = routes[start:end].tolist()
        else:
            for i, row in enumerate(turn.routed_experts):
                if all(e < 0 for e in row):
                    turn.routed_experts[i] = routes[start + i].tolist()
        start = end
    if start != len(routes) - len(sample.token_ids):
        raise ValueError(
            f"the sample's routing covers a prompt of {len(routes) - len(sample.token_ids)} tokens, the turns before "
            f"it hold {start}"
        )


def policy_turn(
    sample: Sample, text: str, sampling: SamplingParams, *, reward: float = 0.0, rewards: dict | None = None
) -> Turn:
    """An assistant turn from a policy sample, with its logprobs and inference metadata (and its tokens' routing when
    the sample carries a mixture of experts' (`Sample.routed_experts`))."""
    routes = sample.routed_experts
    n = len(sample.token_ids)
    return Turn(
        routed_experts=None if routes is None else routes[len(routes) - n :].tolist(),
        role="assistant",
        message=text,
        token_ids=list(sample.token_ids),
        sampler_logprobs=list(sample.sampler_logprobs),
        reward=float(reward),
        rewards=dict(rewards or {}),
        inference_metadata=InferenceMetadata(
            server=sample.server,
            temperature=sampling.temperature,
            max_tokens=sampling.max_tokens,
            version_start=sample.version_start,
            version_end=sample.version_end,
            token_versions=None if sample.token_versions is None else list(sample.token_versions),
            finish_reason=sample.finish_reason,
            latency_s=sample.latency_s,
        ),
        timestamp=time.time(),
    )


def reference_examples(env: Environment, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt_ids, completion_ids + the end of the turn) of the reference completions of `env`'s training problems,
    for a supervised warm start (problems without one are skipped; environments without `encode_prompt` give none).
    The turn ends with the first of a single-turn environment's `stop_token_ids` (EOS, or the chat template's
    end-of-turn token), else EOS."""
    encode = getattr(env, "encode_prompt", None)
    if encode is None:
        return []
    eos = tokenizer.eos_token_id
    end = env.stop_token_ids[:1] if isinstance(env, SingleTurnEnvironment) else ([] if eos is None else [eos])
    out = []
    for p in env.train_problems():
        completion = env.reference_completion(p)
        if completion is None:
            continue
        ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        out.append((encode(p), ids + end))
    return out


async def run_groups(
    env: Environment,
    servers: list[str],
    problems: list[Problem],
    group_size: int,
    sampling: SamplingParams,
    api_key: str | None = None,
) -> list[RolloutGroup]:
    """One group per problem, all concurrently, through a client of their own (closed afterwards; `api_key`: the
    servers' `inference.api_key`)."""
    client = PolicyClient(servers, api_key=api_key)
    try:
        return list(await asyncio.gather(*(env.run_group(client, p, group_size, sampling) for p in problems)))
    finally:
        await client.aclose()


def load_environment_class(path: str) -> type[Environment]:
    """Resolve 'package.module:ClassName' (or 'package.module.ClassName') to an Environment subclass."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
        cls = getattr(module, attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"environment class {path!r} cannot be imported: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"{path!r} is not an Environment subclass")
    return cls
