"""`AgentEnvironment`: trains a user's agent, written against the `openai` SDK, through the capturing chat route.

The agent is an async function `agent(client: openai.AsyncOpenAI, task: dict) -> result` (env arg `agent`: an import
path `package.module:function`, or a file `path/to/agent.py:function`, relative to the working directory). It owns
its loop — messages, tools, retries — and talks to the policy server's `/v1/chat/completions` through `client`.
`task` is the problem without its answer: `{"id", "prompt", **fields}`.

An episode:

1. a fresh session id; `client` sends it as `X-Session-Id` on every request, with the environment's sampling as
   `X-Sampling-Temperature` and `X-Sampling-Max-Tokens` (the server applies them whatever the agent asks for, so
   the learner's temperature is the sampler's and held-out greedy evaluation is greedy);
2. the agent runs; an exception from it (e.g. a reply it could not parse, a conversation that outgrew the context) is
   recorded in `metadata['agent_error']` and scores the result as None — the model's doing is rewarded, not hidden;
   a server that cannot be reached or fails (5xx) fails the episode;
3. the session's records are collected from the server (`POST /v1/sessions/{id}/pop`) and assembled into the
   rollout token-exact (`marin_rl.envs.captured`: rollouts whose turns do not extend each other are marked and dropped
   by the replay buffer with a counted reason);
4. the verifier (env arg `verifier`, a reward function `(prompt, completion, prompt_ids, completion_ids, answer,
   ...)`, named `correct`) scores `str(result)` against the problem's answer; the rewards go on the last policy turn.

Tasks come from another environment's problems (env arg `tasks`, its class path, built with `task_args`): e.g. the
calculator environment's arithmetic problems. Warm start: when the agent's module defines `demonstration(task) ->
{"messages": [...], "tools": [...]}` (a correct episode in OpenAI's message format, as the agent would send it), the
environment renders it as the server would and uses it as the reference completion.

With the Ray-less local backend (an in-process policy client), the agent talks to the same OpenAI front end served
in-process (`httpx.ASGITransport`), so the agent cannot tell the difference.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from marin_rl.bounds import bounded
from marin_rl.envs.base import Environment, Problem, SamplingParams, load_environment_class
from marin_rl.envs.captured import assemble_rollout
from marin_rl.envs.rewards import aevaluate_rewards, combine_rewards
from marin_rl.inference.chat import (
    MAX_TOKENS_HEADER,
    TEMPERATURE_HEADER,
    ChatMessage,
    render_prompt,
    template_messages,
)
from marin_rl.inference.client import PolicyClient, ServerError
from marin_rl.inference.http_server import client_limits
from marin_rl.inference.openai_api import openai_app
from marin_rl.inference.sessions import SESSION_HEADER, SessionRecords
from marin_rl.types import Rollout

logger = logging.getLogger("marin_rl")


def load_object(path: str, what: str) -> Any:
    """The object an import path names: `package.module:attr`, or `path/to/file.py:attr` (relative to the working
    directory). Raises ValueError naming `what` and the path when it cannot be loaded."""
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {path!r} must be 'package.module:name' or 'path/to/file.py:name'")
    try:
        if module_name.endswith(".py"):
            file = Path(module_name).resolve()
            if not file.is_file():
                raise ValueError(f"no file {file}")
            spec = importlib.util.spec_from_file_location(f"_marin_rl_agent_{file.stem}", file)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError, ValueError, OSError, SyntaxError) as e:
        raise ValueError(f"{what} {path!r} cannot be loaded: {e}") from e


class AgentEnvironment(Environment):
    """Episodes run by a user's `openai`-SDK agent against the capturing chat route (module docstring).

    Its arguments are `Args`: the agent, the environment whose problems are its tasks, the verifier.
    """

    name = "agent"
    reward_weights = {"correct": 1.0}
    driver_check = True  # construction imports the agent and builds the task problems: a bad path stops the run early

    @dataclass(kw_only=True)
    class Args(Environment.Args):
        agent: str
        """Import path of the async agent function, 'package.module:name' (or a file, 'path/to/file.py:name')."""
        tasks: str
        """Class path of the environment whose problems are the tasks."""
        task_args: dict[str, Any] | None = None
        """The task environment's arguments."""
        verifier: str = "marin_rl.envs.rewards:exact_match"
        """Import path of the reward function named 'correct'."""
        request_timeout_s: float = bounded(600.0, gt=0)
        """The agent's client's timeout per request (seconds)."""

    args: Args

    def __init__(self, tokenizer, **args):
        super().__init__(tokenizer, **args)
        agent, tasks = self.args.agent, self.args.tasks
        self.agent = load_object(agent, "agent")
        if not inspect.iscoroutinefunction(self.agent):
            raise ValueError(f"agent {agent!r} must be an async function agent(client, task)")
        self.demonstration = getattr(self.agent, "__globals__", {}).get("demonstration")
        self.verifier = load_object(self.args.verifier, "verifier")
        self.reward_functions = {"correct": self.verifier}
        self.request_timeout_s = float(self.args.request_timeout_s)
        self.task_env = load_environment_class(tasks)(tokenizer, seed=self.seed, **(self.args.task_args or {}))
        self._in_process_apps: dict[int, Any] = {}

    def train_problems(self) -> list[Problem]:
        return self.task_env.train_problems()

    def eval_problems(self) -> list[Problem]:
        return self.task_env.eval_problems()

    @staticmethod
    def task(problem: Problem) -> dict[str, Any]:
        """What the agent is given: the problem without its answer."""
        return {"id": problem.id, "prompt": problem.prompt, **problem.fields}

    # ---- warm start -----------------------------------------------------------------------------------
    def _demonstration_ids(self, problem: Problem) -> tuple[list[int], list[int]] | None:
        if self.demonstration is None:
            return None
        demo = self.demonstration(self.task(problem))
        messages = [ChatMessage.model_validate(m) for m in demo["messages"]]
        tools = demo.get("tools") or None
        assistant = [i for i, m in enumerate(messages) if m.role == "assistant"]
        if not assistant or assistant[-1] != len(messages) - 1:
            raise ValueError(f"{self.name}: a demonstration must end with the assistant's final message")
        rendered = template_messages(messages, self.tokenizer)
        prompt = render_prompt(self.tokenizer, rendered[: assistant[0]], tools)
        before_last = render_prompt(self.tokenizer, rendered[: assistant[-1]], tools)
        if before_last[: len(prompt)] != prompt:
            raise ValueError(f"{self.name}: the chat template renders the demonstration's first prompt differently")
        last = self.tokenizer(rendered[-1]["content"], add_special_tokens=False)["input_ids"]
        return prompt, before_last[len(prompt) :] + list(last)

    def encode_prompt(self, problem: Problem) -> list[int]:
        """Token ids of the demonstration's first prompt (what the agent's first request renders to)."""
        ids = self._demonstration_ids(problem)
        if ids is None:
            raise ValueError(f"{self.name}: the agent's module defines no demonstration(task)")
        return ids[0]

    def reference_completion(self, problem: Problem) -> str | None:
        """The demonstration after its first prompt, as the server renders it (the last message left open)."""
        ids = self._demonstration_ids(problem)
        return None if ids is None else self.tokenizer.decode(ids[1], skip_special_tokens=False)

    # ---- episodes -------------------------------------------------------------------------------------
    def _endpoint(self, policy) -> tuple[str, httpx.AsyncBaseTransport | None, str | None]:
        """(base URL, transport, API key) of a server of `policy`: an HTTP server it samples from, or the OpenAI front
        end over its in-process backend."""
        backend = getattr(policy, "backend", None)
        if backend is not None:
            app = self._in_process_apps.get(id(backend))
            if app is None:
                app = self._in_process_apps[id(backend)] = openai_app(backend, f"{self.name} in-process front end")
            return "http://in-process", httpx.ASGITransport(app=app), None
        if not isinstance(getattr(policy, "servers", None), list) or not hasattr(policy, "pick_server"):
            raise ValueError(f"{self.name}: the policy client {type(policy).__name__} has no chat server for agents")
        return f"http://{policy.pick_server()}", None, getattr(policy, "api_key", None)

    async def run_episode(self, policy: PolicyClient, problem: Problem, sampling: SamplingParams) -> Rollout:
        import openai

        session = uuid.uuid4().hex
        base, transport, api_key = self._endpoint(policy)
        headers = {
            SESSION_HEADER: session,
            TEMPERATURE_HEADER: repr(float(sampling.temperature)),
            MAX_TOKENS_HEADER: str(int(sampling.max_tokens)),
        }
        auth = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        async with httpx.AsyncClient(
            transport=transport, timeout=self.request_timeout_s, limits=client_limits()
        ) as http:
            client = openai.AsyncOpenAI(
                base_url=f"{base}/v1",
                api_key=api_key or "unused",
                default_headers=headers,
                http_client=http,
                max_retries=0,
            )
            error = None
            try:
                result = await self.agent(client, self.task(problem))
            except (openai.APIConnectionError, openai.InternalServerError):
                raise
            except Exception as e:  # noqa: BLE001 - the agent's failure is the episode's outcome
                result, error = None, f"{type(e).__name__}: {e}"
                logger.info("%s: the agent failed on problem %s: %s", self.name, problem.id, error)
            answer = await http.post(f"{base}/v1/sessions/{session}/pop", headers=auth)
            if answer.status_code != 200:
                raise ServerError(base, answer.status_code, answer.text[:500])
        records = SessionRecords.from_dict(answer.json())
        rollout = assemble_rollout(records, environment=self.name, problem_id=problem.id, tokenizer=self.tokenizer)
        completion = "" if result is None else str(result)
        last = next(t for t in reversed(rollout.turns) if t.is_sampled)
        fields = {"answer": problem.answer, **problem.fields}
        prompt_ids = rollout.turns[0].token_ids
        rewards = await aevaluate_rewards(
            self.reward_functions, problem.prompt, completion, prompt_ids, list(last.token_ids), fields
        )
        added = await self.added_reward_values(problem, problem.prompt, completion, prompt_ids, list(last.token_ids))
        last.rewards = {**rewards, **added}
        last.reward = combine_rewards(last.rewards, self.reward_weights)
        rollout.metadata.update(
            {"answer": problem.answer, "agent_result": completion[:500], "agent_error": error, "problem": problem.id}
        )
        return rollout
