"""AgentEnvironment: an `openai`-SDK agent (experiments/openai_agent.py) run against the capturing chat route, over
HTTP and in process; rollouts from the session's capture; the verifier's reward; the demonstration as warm start;
and, in the slow tier, the agent trained end to end."""

import asyncio
import dataclasses
import json

import equinox as eqx
import jax
import numpy as np
import pyarrow.parquet as pq
import pytest

from marin_rl.envs.agent import AgentEnvironment, load_object
from marin_rl.envs.base import SamplingParams, reference_examples
from marin_rl.inference.client import PolicyClient
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.inference.local_client import InProcessPolicyClient
from marin_rl.model.build import build_model
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.run import parse_config, run
from marin_rl.tokenizer import build_char_tokenizer
from marin_rl.types import DROP_REASON

AGENT = "experiments/openai_agent.py:solve"
TASKS = "marin_rl.envs.calculator:CalculatorEnvironment"
TASK_ARGS = {"min_digits": 2, "max_digits": 2, "num_train": 20, "num_eval": 5, "prompt_template": "{expression}="}
VERIFIER = "marin_rl.envs.calculator:final_number_correct"


def _env(tok, **kwargs):
    args = {"agent": AGENT, "tasks": TASKS, "task_args": TASK_ARGS, "verifier": VERIFIER, **kwargs}
    return AgentEnvironment(tok, **args)


@pytest.fixture(scope="module")
def server():
    tok = build_char_tokenizer()
    model = build_model(ModelConfig(architecture=dataclasses.replace(tiny_llama(), max_seq_len=512)), len(tok))
    srv = LevanterInferenceServer(
        model,
        tok,
        InferenceConfig(max_seqs=8, max_seq_len=512, levanter=LevanterServerConfig(page_size=16, prefill_tokens=2048)),
    )
    srv.apply_weights(3, [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))])
    address = srv.start()
    yield tok, srv, address
    srv.stop()


def test_the_demonstration_is_the_warm_start_as_the_server_renders_it():
    tok = build_char_tokenizer()
    env = _env(tok)
    problem = env.train_problems()[0]
    expression = problem.fields["expression"]
    [(prompt, completion), *_] = reference_examples(env, tok)
    assert tok.decode(prompt, skip_special_tokens=False).endswith(f"<|user|>{expression}=<eos><|assistant|>")
    answer = problem.answer
    given = env.demonstration(env.task(problem))["messages"][-1]["content"]
    expected = (
        f'<tool_call>{{"name": "calc", "arguments": {{"e": "{expression}"}}}}</tool_call><eos>'
        f"<|tool|>{answer}<eos><|assistant|>{given}<eos>"
    )
    assert tok.decode(completion, skip_special_tokens=False) == expected
    assert "answer" not in env.task(problem)  # the agent never sees the answer


def test_the_demonstrator_slips_on_a_fixed_fraction_of_the_tasks():
    """The warm start's demonstrations answer the calculator's result for ~60% of the tasks and slip by ±1 or ±10 on
    the rest, the same tasks every time (the expression's hash decides), so RL has wrong answers to correct."""
    tok = build_char_tokenizer()
    env = _env(tok, task_args={**TASK_ARGS, "num_train": 1000})
    slips = []
    for problem in env.train_problems():
        messages = env.demonstration(env.task(problem))["messages"]
        assert messages[2]["content"] == problem.answer  # the tool's result is right
        assert env.demonstration(env.task(problem))["messages"] == messages  # the same task slips the same way
        slips.append(int(messages[-1]["content"]) - int(problem.answer))
    assert set(slips) == {0, -1, 1, -10, 10}
    assert 0.35 < np.mean([d != 0 for d in slips]) < 0.45


def test_agent_episodes_over_http_and_in_process_are_assembled_from_the_capture(server):
    tok, srv, address = server
    env = _env(tok)
    problems = env.train_problems()[:2]
    sampling = SamplingParams(temperature=1.0, max_tokens=24)

    async def http_group():
        client = PolicyClient([address])
        try:
            return await env.run_group(client, problems[0], 3, sampling)
        finally:
            await client.aclose()

    group = asyncio.run(http_group())
    in_process = asyncio.run(env.run_group(InProcessPolicyClient(srv), problems[1], 2, sampling))
    for rollout in group.rollouts + in_process.rollouts:
        rollout.validate(len(tok))
        assert DROP_REASON not in rollout.metadata, rollout.metadata
        problem = problems[0] if rollout in group.rollouts else problems[1]
        assert rollout.turns[0].token_ids == env.encode_prompt(problem)
        sampled = [t for t in rollout.turns if t.is_sampled]
        assert sampled and all(t.inference_metadata.token_versions == [3] * len(t.token_ids) for t in sampled)
        assert all(t.inference_metadata.temperature == 1.0 and len(t.token_ids) <= 24 for t in sampled)
        assert sampled[-1].rewards == {"correct": 0.0}  # a random policy does not answer
        assert rollout.metadata["agent_error"] is None
    assert len({r.metadata["session_id"] for r in group.rollouts}) == 3  # one session per episode
    assert len(srv.app.state.sessions) == 0  # every session was collected


def test_a_correct_answer_is_rewarded_and_an_agent_failure_is_recorded(server, tmp_path):
    tok, _, address = server
    agent = tmp_path / "agents.py"
    agent.write_text(
        "async def cheat(client, task):\n"
        "    await client.chat.completions.create(model='policy', messages=[{'role': 'user', 'content': 'hi'}])\n"
        "    a, b = task['expression'].split('*')\n"
        "    return f'The answer is {int(a) * int(b)}.'\n"
        "\n"
        "async def crash(client, task):\n"
        "    await client.chat.completions.create(model='policy', messages=[{'role': 'user', 'content': 'hi'}])\n"
        "    raise KeyError('tool')\n"
    )
    sampling = SamplingParams(temperature=1.0, max_tokens=4)

    async def one(name):
        env = _env(tok, agent=f"{agent}:{name}")
        client = PolicyClient([address])
        try:
            return await env.run_episode(client, env.train_problems()[0], sampling)
        finally:
            await client.aclose()

    good, bad = asyncio.run(one("cheat")), asyncio.run(one("crash"))
    assert good.reward == 1.0 and good.turns[-1].rewards == {"correct": 1.0}
    assert bad.reward == 0.0 and bad.metadata["agent_error"] == "KeyError: 'tool'"


def test_bad_agent_paths_are_named():
    tok = build_char_tokenizer()
    with pytest.raises(ValueError, match="agent 'experiments/nowhere.py:solve' cannot be loaded"):
        _env(tok, agent="experiments/nowhere.py:solve")
    with pytest.raises(ValueError, match="must be 'package.module:name'"):
        load_object("solve", "agent")
    with pytest.raises(ValueError, match="must be an async function"):
        _env(tok, agent="experiments/openai_agent.py:calc")


# The suite's longest test: 800 warm-start steps (uncached on a fresh machine, 310 s alone) and 60 RL steps with two
# evaluations (364 s alone on the dense engine; 1,195 s in all on the paged engine it used before, which took 1,260 s
# beside the other worker's tests in a full run). This bound is for a slow machine under load, not for a hang (every
# wait in a run is bounded).
@pytest.mark.timeout(2400)
@pytest.mark.slow
def test_the_sdk_only_agent_trains_end_to_end(tmp_path):
    """experiments/openai_agent.yaml as shipped: the agent (openai SDK only), warm-started on its unreliable
    demonstrations, is trained through the capturing chat route and learns to copy the calculator's result: held-out
    reward rises by at least 0.2. Every group is accepted but those dynamic sampling rejects for having no signal,
    every step trains on a gradient, episodes span several chat requests, and at most 2% of the rollouts are dropped for
    a broken prefix."""
    out = tmp_path / "run"
    config = parse_config(
        ["--config", "experiments/openai_agent.yaml", "--output_dir", str(out), "--orchestrator.num_cpus", "2"]
    )
    summary = run(config)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "learner/loss" in r]
    assert len(steps) == config.orchestrator.num_steps
    last = steps[-1]
    assert last["replays/openai_agent/accepted_groups"] > 0, last
    assert last["replays/openai_agent/rejected"] == last.get("replays/openai_agent/rejected/zero_advantage", 0), last
    # dynamic sampling: no step is an optimizer update without a gradient (Adam's momentum alone moved the policy
    # into broken tool calls in runs without it)
    assert all(r["learner/grad_norm"] > 0 for r in steps), [r["learner/grad_norm"] for r in steps]
    # A rollout whose next prompt does not extend what the engine saw (the template re-serialises the tool-call JSON
    # the policy sampled in another spacing) is dropped and counted, never trained on (6 of ~5,700 in one measured run)
    rollouts = last["replays/openai_agent/sampled_groups"] * config.envs[0].group_size
    assert last.get("replays/openai_agent/dropped/prefix_mismatch", 0) <= 0.02 * rollouts, last
    persisted = [
        r for f in sorted((out / "rollouts" / "openai_agent").glob("*.parquet")) for r in pq.read_table(f).to_pylist()
    ]
    requests = [json.loads(r["metadata_json"])["requests"] for r in persisted]
    assert requests and max(requests) >= 2, "episodes call the model again after a tool result"
    gain = summary["eval_reward_end"] - summary["eval_reward_start"]
    assert gain >= 0.2, (summary["eval_reward_start"], summary["eval_reward_end"])
