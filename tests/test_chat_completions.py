"""The chat-completions route of the shared OpenAI front end, through the official `openai` client: tools and tool
calls, OpenAI-shaped refusals naming the field, token capture by session, and the rollout assembled from it (token for
token what the engine saw; dropped with a counted reason when re-rendering changes an earlier turn)."""

import asyncio
import dataclasses
import json

import equinox as eqx
import httpx
import jax
import numpy as np
import openai
import pytest

from marin_rl.envs.captured import PREFIX_MISMATCH, assemble_rollout
from marin_rl.inference.chat import end_of_turn_ids
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.inference.sessions import CapturedCompletion, SessionRecords, SessionStore
from marin_rl.learner.config import LearnerConfig, WarmStartConfig
from marin_rl.learner.learner import Learner
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.replay.buffer import ReplayBuffer, ReplayConfig
from marin_rl.tokenizer import build_char_tokenizer
from marin_rl.tool_calls import format_tool_call
from marin_rl.types import DROP_REASON, RolloutGroup

TOOLS = [
    {
        "type": "function",
        "function": {"name": "calc", "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}},
    }
]
QUESTION = [{"role": "user", "content": "12*34="}]
SEQ = 512


class RecordingServer(LevanterInferenceServer):
    """The embedded server, keeping every prompt its engine was given and what it sampled."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[list[int], list[int]]] = []

    async def complete(self, request, prompts):
        out = await super().complete(request, prompts)
        per = request.n
        for i, c in enumerate(out):
            self.seen.append((list(prompts[i // per]), list(c.token_ids)))
        return out


def _server(tok, model) -> RecordingServer:
    server = RecordingServer(
        model,
        tok,
        InferenceConfig(max_seqs=8, max_seq_len=SEQ, levanter=LevanterServerConfig(page_size=16, prefill_tokens=2048)),
    )
    server.apply_weights(0, [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))])
    return server


def _transcript(tok):
    """The tool-using episode the fixture's policy is taught: call calc, read the result, answer."""
    call = format_tool_call("calc", {"e": "12*34"})
    first = tok.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    then = QUESTION + [{"role": "assistant", "content": call}, {"role": "tool", "content": "408"}]
    second = tok.apply_chat_template(then, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    eos = tok.eos_token_id
    return [
        (list(first), tok(call, add_special_tokens=False)["input_ids"] + [eos]),
        (list(second), tok("408", add_special_tokens=False)["input_ids"] + [eos]),
    ]


@pytest.fixture(scope="module")
def served():
    tok = build_char_tokenizer()
    arch = dataclasses.replace(tiny_llama(), max_seq_len=SEQ)
    learner = Learner(
        ModelConfig(architecture=arch),
        LearnerConfig(warm_start=WarmStartConfig(steps=120, batch_rows=2, cache_dir=None)),
        len(tok),
    )
    learner.warm_start(_transcript(tok), SEQ)  # a policy that answers the transcript greedily
    server = _server(tok, learner.model)
    address = server.start()
    yield tok, server, address, learner.model
    server.stop()


def _client(address, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0, **kwargs)


def test_openai_client_calls_a_tool_and_the_session_is_captured_token_exact(served):
    tok, server, address, _ = served
    client = _client(address, default_headers={"X-Session-Id": "episode-1"})
    server.seen.clear()
    first = client.chat.completions.create(
        model="policy", messages=QUESTION, tools=TOOLS, temperature=0, max_completion_tokens=100, logprobs=True
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"e": "12*34"}
    assert call.id.startswith("call_") and choice.message.content is None
    assert len(choice.logprobs.content) == len(server.seen[0][1])  # one logprob per sampled token, EOS included
    assert first.usage.prompt_tokens == len(server.seen[0][0])

    # the agent answers the call and sends the conversation back, as OpenAI's client would
    messages = QUESTION + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "408"},
    ]
    second = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, temperature=0)
    assert second.choices[0].message.content == "408" and second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.tool_calls is None

    popped = httpx.post(f"http://{address}/v1/sessions/episode-1/pop").json()
    assert len(popped["records"]) == 2 and not popped["overflowed"]
    assert httpx.post(f"http://{address}/v1/sessions/episode-1/pop").json()["records"] == []  # popped = forgotten

    rollout = assemble_rollout(SessionRecords.from_dict(popped), environment="chat", problem_id="p", tokenizer=tok)
    assert DROP_REASON not in rollout.metadata
    (p1, s1), (p2, s2) = server.seen
    # the whole rollout is the last prompt the engine saw and what it sampled, token for token
    assert rollout.token_ids == p2 + s2
    assert p2[: len(p1) + len(s1)] == p1 + s1  # the prefix property held
    assert [t.role for t in rollout.turns] == ["user", "assistant", "tool", "assistant"]
    assert rollout.turns[0].token_ids == p1 and rollout.turns[1].token_ids == s1 and rollout.turns[3].token_ids == s2
    assert rollout.turns[2].message == "<|tool|>408<eos><|assistant|>"  # what the template inserted, not trained
    mask = rollout.loss_mask()
    assert mask.sum() == len(s1) + len(s2)
    assert mask[len(p1) : len(p1) + len(s1)].all() and not mask[len(p1) + len(s1) : len(p2)].any()
    assert rollout.turns[1].sampler_logprobs == pytest.approx([c.logprob for c in choice.logprobs.content])
    assert rollout.turns[1].inference_metadata.token_versions == [0] * len(s1)
    rollout.validate(len(tok))


def test_session_by_metadata_or_user_and_an_unnamed_request_is_not_captured(served):
    _, server, address, _ = served
    client = _client(address)
    store: SessionStore = server.app.state.sessions
    before = store.recorded
    client.chat.completions.create(model="policy", messages=QUESTION, max_tokens=4)
    assert store.recorded == before
    client.chat.completions.create(model="policy", messages=QUESTION, max_tokens=4, n=2, user="by-user")
    client.chat.completions.create(model="policy", messages=QUESTION, max_tokens=4, metadata={"session_id": "by-md"})
    by_user, by_md = store.pop("by-user"), store.pop("by-md")
    assert [r.choice_index for r in by_user.records] == [0, 1] and by_user.records[0].num_choices == 2
    assert len(by_md.records) == 1 and by_md.records[0].max_tokens == 4


def test_sampling_headers_set_the_temperature_and_cap_the_tokens(served):
    _, server, address, _ = served
    client = _client(address, default_headers={"X-Session-Id": "hdr", "X-Sampling-Temperature": "0.5"})
    client.chat.completions.create(
        model="policy", messages=QUESTION, max_tokens=50, extra_headers={"X-Sampling-Max-Tokens": "3"}
    )
    [record] = server.app.state.sessions.pop("hdr").records
    assert record.temperature == 0.5 and record.max_tokens == 3 and len(record.token_ids) <= 3


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": QUESTION, "tool_choice": "auto"}, "tool_choice"),
        ({"messages": QUESTION, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        ({"messages": QUESTION, "tools": [{"type": "function"}]}, "tools[0].function"),
        ({"messages": QUESTION, "stream": True}, "stream"),
        ({"messages": QUESTION, "logprobs": True, "top_logprobs": 3}, "top_logprobs"),
        ({"messages": QUESTION, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": QUESTION, "n": "2"}, "n"),
        ({"messages": QUESTION, "temperature": -1}, "temperature"),
        ({"messages": [{"role": "user", "content": "x" * SEQ}]}, "messages"),
        (
            {
                "messages": QUESTION
                + [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "calc", "arguments": "{"}}],
                    }
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_malformed_chat_requests_get_openai_errors_naming_the_field(served, body, param):
    _, _, address, _ = served
    r = httpx.post(f"http://{address}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert set(error) == {"message", "type", "param", "code"}


def test_the_openai_client_raises_bad_request_with_the_field(served):
    _, _, address, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        _client(address).chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS, tool_choice="required")
    assert e.value.status_code == 400 and e.value.param == "tool_choice"


def test_rerendering_that_changes_an_earlier_turn_is_dropped_with_a_counted_reason(served):
    """A template that writes earlier assistant turns differently from how they were sampled (here: only the last
    message keeps its content, as templates that strip earlier reasoning do) breaks the prefix property."""
    tok, _, _, model = served
    forgetful = build_char_tokenizer()
    forgetful.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}"
        "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    server = _server(forgetful, model)
    address = server.start()
    try:
        client = _client(address, default_headers={"X-Session-Id": "forgetful"})
        first = client.chat.completions.create(model="policy", messages=QUESTION, max_tokens=8, temperature=0)
        text = first.choices[0].message.content
        assert text != "..."
        client.chat.completions.create(
            model="policy",
            messages=QUESTION + [{"role": "assistant", "content": text}, {"role": "user", "content": "again"}],
            max_tokens=8,
        )
        session = server.app.state.sessions.pop("forgetful")
    finally:
        server.stop()
    rollout = assemble_rollout(session, environment="chat", problem_id="p")
    assert rollout.metadata[DROP_REASON] == PREFIX_MISMATCH
    assert rollout.metadata["drop_detail"]["request"] == 1
    rollout.validate(len(tok))  # what it holds (the turns before the break) is well formed

    # the replay buffer drops it unused and counts why; the group's other rollout is queued
    good = assemble_rollout(
        SessionRecords("ok", session.records[:1]), environment="chat", problem_id="p", tokenizer=forgetful
    )
    good.turns[-1].reward, rollout.turns[-1].reward = 1.0, 0.0
    buffer = ReplayBuffer("chat", ReplayConfig(min_group_size=2), vocab_size=len(tok))
    admission = buffer.admit(RolloutGroup("chat", "p", [good, rollout]))
    assert admission.accepted and admission.queued == 1
    assert buffer.metrics(0)["replays/chat/dropped/prefix_mismatch"] == 1


def test_end_of_turn_ids_and_the_store_bounds():
    tok = build_char_tokenizer()
    assert end_of_turn_ids(tok) == [tok.eos_token_id]
    qwen_like = build_char_tokenizer()
    qwen_like.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|tool|>{% endfor %}"
    assert end_of_turn_ids(qwen_like) == [tok.eos_token_id, tok.convert_tokens_to_ids("<|tool|>")]

    def record():
        return CapturedCompletion("r", 0, 1, [1], [2], [-0.1], [0], 0, "", "stop", 1.0, 4, "user", "s", 0.0)

    store = SessionStore(max_sessions=2, max_records=2, ttl_s=60)
    store.add("a", [record()])
    store.add("b", [record()])
    store.add("a", [record(), record()])  # a third record of 'a': not kept, 'a' marked
    store.add("c", [record()])  # evicts 'b', the least recently used
    assert store.evicted == 1 and store.overflowed == 1
    a = store.pop("a")
    assert a.overflowed and [r.sequence for r in a.records] == [0, 1]
    assert store.pop("b").records == [] and len(store) == 1
    with pytest.raises(ValueError, match="max_sessions"):
        SessionStore(max_sessions=0)


def test_async_client_sessions_do_not_mix(served):
    _, server, address, _ = served

    async def episode(i):
        client = openai.AsyncOpenAI(
            base_url=f"http://{address}/v1", api_key="unused", default_headers={"X-Session-Id": f"s{i}"}
        )
        await client.chat.completions.create(model="policy", messages=QUESTION, max_tokens=3)
        await client.close()

    async def main():
        await asyncio.gather(*(episode(i) for i in range(4)))

    asyncio.run(main())
    sessions = [server.app.state.sessions.pop(f"s{i}") for i in range(4)]
    assert all(len(s.records) == 1 for s in sessions)
