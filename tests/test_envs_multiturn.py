"""Multi-turn episodes on the embedded server: token exactness against the server's own view, loss masks after
packing, turn/token limits, rendered deltas for several chat templates, and reward functions."""

import asyncio
import dataclasses
import json
import math

import equinox as eqx
import jax
import numpy as np
import pytest

from marin_rl.envs.arithmetic import AdditionEnvironment
from marin_rl.envs.base import Problem, SamplingParams, run_groups
from marin_rl.envs.multi_turn import (
    ChatTemplateError,
    Conversation,
    EnvResponse,
    MultiTurnEnvironment,
    rendered_delta,
)
from marin_rl.envs.rewards import (
    RewardFunctionError,
    aevaluate_rewards,
    check_reward_weights,
    combine_rewards,
    evaluate_rewards,
    exact_match,
)
from marin_rl.inference.client import Sample
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.model.build import build_model
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.replay.packing import Sequence, pack
from marin_rl.tokenizer import build_char_tokenizer

MAX_SEQ_LEN = 256


class RecordingApp:
    """ASGI wrapper around the server's app: records every /v1/completions request body and response body."""

    def __init__(self, app):
        self.app = app
        self.log: list[tuple[dict, dict]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            return await self.app(scope, receive, send)
        request, response = [], []

        async def recv():
            message = await receive()
            if message["type"] == "http.request":
                request.append(message.get("body", b""))
            return message

        async def snd(message):
            if message["type"] == "http.response.body":
                response.append(message.get("body", b""))
            await send(message)

        await self.app(scope, recv, snd)
        self.log.append((json.loads(b"".join(request)), json.loads(b"".join(response))))


@pytest.fixture(scope="module")
def server():
    tok = build_char_tokenizer()
    model = build_model(ModelConfig(architecture=dataclasses.replace(tiny_llama(), max_seq_len=MAX_SEQ_LEN)), len(tok))
    srv = LevanterInferenceServer(
        model,
        tok,
        InferenceConfig(
            max_seqs=16, max_seq_len=MAX_SEQ_LEN, levanter=LevanterServerConfig(page_size=16, prefill_tokens=1024)
        ),
    )
    srv.apply_weights(0, [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))])
    recorder = RecordingApp(srv.app)
    srv.app = recorder  # served from start(): every request passes through the recorder
    address = srv.start()
    yield tok, address, recorder
    srv.stop()


class ContinueEnvironment(MultiTurnEnvironment):
    """Replies 'continue' to every policy turn (until `stop_after` policy turns, if set), with a per-turn reward."""

    name = "continue"
    reward_weights = {"step": 0.5, "length": 0.01}

    def __init__(self, tokenizer, *, stop_after: int | None = None, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.stop_after = stop_after
        self.problems = [Problem(id=f"p{i}", prompt=f"Say {i}.", answer=str(i)) for i in range(3)]
        self.reward_functions = {"length": self._length}

    @staticmethod
    def _length(prompt, completion, prompt_ids, completion_ids, conversation):
        return float(conversation.num_tokens)

    def train_problems(self):
        return self.problems

    def eval_problems(self):
        return self.problems

    async def env_response(self, problem, conversation):
        n = len(conversation.policy_turns)
        if self.stop_after is not None and n >= self.stop_after:
            return EnvResponse(None, {"step": 2.0})
        return EnvResponse([{"role": "user", "content": f"continue {n}"}], {"step": 1.0})


def _run(env, address, n_problems, group_size, sampling):
    return asyncio.run(run_groups(env, [address], env.train_problems()[:n_problems], group_size, sampling))


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False)


def test_multi_turn_tokens_match_the_server_view_and_loss_mask(server):
    tok, address, recorder = server
    env = ContinueEnvironment(tok, max_turns=3)
    sampling = SamplingParams(temperature=1.0, max_tokens=6)
    start = len(recorder.log)
    groups = _run(env, address, 2, 3, sampling)
    log = recorder.log[start:]
    rollouts = [r for g in groups for r in g.rollouts]
    assert len(rollouts) == 6
    # The server's view: (prompt ids it received, token ids and logprobs it returned), one prompt per policy turn
    # (the client sends the turns it has at once in one request with a list of prompts; choice i answers prompt i).
    served = []
    for body, resp in log:
        assert body["n"] == 1 and body["return_token_ids"] and body["stop_token_ids"] == [tok.eos_token_id]
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        choices = sorted(resp["choices"], key=lambda c: c["index"])
        assert len(choices) == len(prompts)
        for prompt, choice in zip(prompts, choices, strict=True):
            served.append((tuple(prompt), tuple(choice["token_ids"]), tuple(choice["logprobs"]["token_logprobs"])))
    assert len(served) == sum(r.metadata["policy_turns"] for r in rollouts) == 6 * 3
    for r in rollouts:
        r.validate(len(tok))
        assert r.metadata["truncated"] and r.metadata["truncation_reason"] == "max_turns" and r.truncated
        assert [t.role for t in r.turns] == ["user", "assistant", "user", "assistant", "user", "assistant"]
        # every policy turn: the prompt is exactly the turns before it, the ids/logprobs exactly what came back
        for i, turn in enumerate(r.turns):
            if turn.is_sampled:
                prefix = tuple(t for prev in r.turns[:i] for t in prev.token_ids)
                assert (prefix, tuple(turn.token_ids), tuple(turn.sampler_logprobs)) in served
        # environment turns: the rendered delta, with <eos> closing the policy turn only if it did not sample it
        for k, (policy, env_turn) in enumerate(zip(r.turns[1::2], r.turns[2::2], strict=False)):
            closed = policy.token_ids[-1] == tok.eos_token_id
            expected = ("" if closed else "<eos>") + f"<|user|>continue {k + 1}<eos><|assistant|>"
            assert _decode(tok, env_turn.token_ids) == expected
            assert closed == (policy.inference_metadata.finish_reason == "stop")
        assert _decode(tok, r.turns[0].token_ids) == f"<|user|>Say {r.problem_id[1:]}.<eos><|assistant|>"
    # the learner's view: packed rows hold the rollout's ids, the loss mask is on exactly the sampled tokens
    batch, placed = pack([Sequence.from_rollout(r, 1.0) for r in rollouts], 6, MAX_SEQ_LEN)
    assert placed == list(range(6))
    segments = [(row, seg) for row in range(batch.num_rows) for seg in sorted(set(batch.segment_ids[row]) - {-1})]
    assert len(segments) == len(rollouts)
    matched = 0
    for r in rollouts:
        ids = np.asarray(r.token_ids)
        for row, seg in segments:
            cols = batch.segment_ids[row] == seg
            if cols.sum() == len(ids) and (batch.input_ids[row, cols] == ids).all():
                sampled = np.concatenate([np.full(len(t.token_ids), t.is_sampled) for t in r.turns])
                assert (batch.loss_mask[row, cols] == sampled).all()
                served_lp = np.concatenate(
                    [t.sampler_logprobs if t.is_sampled else np.zeros(len(t.token_ids)) for t in r.turns]
                )
                np.testing.assert_allclose(batch.sampler_logprobs[row, cols], served_lp, rtol=0, atol=1e-6)
                matched += 1
                break
    assert matched == len(rollouts)
    assert batch.loss_mask.sum() == sum(r.num_sampled_tokens for r in rollouts)


def test_token_limit_truncates_cleanly(server):
    tok, address, recorder = server
    probe = ContinueEnvironment(tok)
    prompt_len = len(probe.encode_prompt(probe.train_problems()[0]))
    limit = prompt_len + 26  # a full first turn (8) and its env turn (14) leave 4 tokens for the second
    env = ContinueEnvironment(tok, max_turns=50, max_episode_tokens=limit)
    sampling = SamplingParams(temperature=1.0, max_tokens=8)
    start = len(recorder.log)
    groups = _run(env, address, 1, 4, sampling)
    log = recorder.log[start:]
    for r in groups[0].rollouts:
        r.validate(len(tok))
        assert r.metadata["truncated"] and r.metadata["truncation_reason"] == "token_limit"
        assert r.num_tokens <= limit
        assert r.turns[-1].is_sampled  # env messages that do not fit are not added
        for i, turn in enumerate(r.turns):
            if turn.is_sampled:
                before = sum(len(t.token_ids) for t in r.turns[:i])
                assert turn.inference_metadata.max_tokens == min(8, limit - before)
    assert all(body["max_tokens"] <= 8 for body, _ in log)
    assert any(body["max_tokens"] < 8 for body, _ in log)  # the budget cut a turn's max_tokens


def test_per_turn_and_episode_rewards_combine_by_weights(server):
    tok, address, _ = server
    env = ContinueEnvironment(tok, stop_after=2, max_turns=5, reward_weights={"step": 0.25, "length": 0.001})
    [group] = _run(env, address, 1, 2, SamplingParams(temperature=1.0, max_tokens=5))
    for r in group.rollouts:
        assert not r.metadata["truncated"] and r.metadata["truncation_reason"] is None
        first, last = [t for t in r.turns if t.is_sampled]
        assert first.rewards == {"step": 1.0} and first.reward == 0.25
        # the env's turn reward (2.0) and the episode's reward function (total tokens) both land on the last turn
        assert last.rewards == {"step": 2.0, "length": float(r.num_tokens)}
        assert math.isclose(last.reward, 0.25 * 2.0 + 0.001 * r.num_tokens)
        assert math.isclose(r.reward, 0.25 * 3.0 + 0.001 * r.num_tokens)
        assert r.metadata["episode_rewards"] == {"length": float(r.num_tokens)}


def test_single_turn_reward_functions_on_the_server(server):
    tok, address, _ = server

    def ends_with_eos(prompt, completion, prompt_ids, completion_ids, **fields):
        return float(completion_ids[-1] == tok.eos_token_id)

    class Addition(AdditionEnvironment):
        reward_functions = {"correct": exact_match, "eos": ends_with_eos}
        reward_weights = {"correct": 1.0, "eos": 0.5}

    env = Addition(tok, max_operand=9, num_eval=5)
    groups = _run(env, address, 3, 4, SamplingParams(temperature=1.0, max_tokens=4))
    for problem, g in zip(env.train_problems()[:3], groups, strict=True):
        for r in g.rollouts:
            prompt, sampled = r.turns
            correct = float(sampled.message.strip() == problem.answer)
            eos = float(sampled.token_ids[-1] == tok.eos_token_id)
            assert sampled.rewards == {"correct": correct, "eos": eos}
            assert sampled.reward == correct + 0.5 * eos


# ---- conversations and rendered deltas (no server) ----------------------------------------------------


def _sample(ids, finish="stop", text=""):
    return Sample(ids, [-0.5] * len(ids), text, finish, 0, 0, "local", 0.0)


def _with_template(template):
    tok = build_char_tokenizer()
    tok.chat_template = template
    return tok


CHATML_LIKE = (  # closes a turn with '<eos>\n' (like ChatML's '<|im_end|>\n'); the policy samples only <eos>
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.mark.parametrize("template", [None, CHATML_LIKE])
def test_env_turn_drops_only_the_closing_the_policy_sampled(template):
    tok = build_char_tokenizer() if template is None else _with_template(template)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    sampling = SamplingParams(max_tokens=8)
    msg = [{"role": "tool", "content": "42"}]
    full = tok.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"}] + msg,
        add_generation_prompt=True,
        tokenize=True,
    )
    for closed in (True, False):
        conv = Conversation(tok, [{"role": "user", "content": "q"}])
        assert conv.stop_token_ids == [tok.eos_token_id]
        conv.add_policy_turn(
            _sample(enc("ab") + ([tok.eos_token_id] if closed else []), "stop" if closed else "length", "ab"), sampling
        )
        turn = conv.add_messages(msg)
        assert turn.role == "tool" and turn.message == "42" and not turn.is_sampled
        # whether or not the policy sampled the end-of-turn token, the ids are those of the rendered conversation
        assert conv.token_ids == full
    assert conv.messages[-2:] == [{"role": "assistant", "content": "ab"}, {"role": "tool", "content": "42"}]
    ids, n_close = rendered_delta(tok, msg)
    assert n_close == (1 if template is None else 2)


def test_conversation_errors():
    tok = build_char_tokenizer()
    conv = Conversation(tok, [{"role": "user", "content": "q"}])
    with pytest.raises(ValueError, match="must follow a policy turn"):
        conv.add_messages([{"role": "user", "content": "x"}])
    conv.add_policy_turn(_sample([10, 2]), SamplingParams())
    with pytest.raises(ValueError, match="two policy turns in a row"):
        conv.add_policy_turn(_sample([10, 2]), SamplingParams())
    with pytest.raises(ValueError, match="roles"):
        conv.add_messages([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="str 'content'"):
        conv.add_messages([{"role": "user", "content": None}])
    dropping = _with_template("{% for m in messages %}<|{{ m['role'] }}|>{% endfor %}")
    with pytest.raises(ChatTemplateError, match="drops assistant content"):
        rendered_delta(dropping, [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="max_turns: must be >= 1, got 0"):
        ContinueEnvironment(tok, max_turns=0)
    with pytest.raises(ValueError, match=r"reward_weights\['step'\] must be a finite number"):
        ContinueEnvironment(tok, reward_weights={"step": float("nan")})


# ---- reward functions ------------------------------------------------------------------------------------


def test_reward_function_signature_fields_and_weights():
    seen = {}

    def wants_answer(prompt, completion, prompt_ids, completion_ids, answer):
        seen["answer"] = answer
        return completion.strip() == answer

    def takes_all(prompt, completion, prompt_ids, completion_ids, **fields):
        seen["fields"] = dict(fields)
        return len(completion_ids) - len(prompt_ids)

    fns = {"correct": wants_answer, "length": takes_all, "exact": exact_match}
    out = evaluate_rewards(fns, "1+1=", " 2", [1, 2, 3, 4], [5, 6], {"answer": "2", "level": "easy"})
    assert out == {"correct": 1.0, "length": -2.0, "exact": 1.0}
    assert seen == {"answer": "2", "fields": {"answer": "2", "level": "easy"}}
    assert combine_rewards(out, {"correct": 2.0, "length": 0.5}) == 2.0 * 1.0 + 0.5 * -2.0  # 'exact' has weight 0
    check_reward_weights({"correct": 1.0}, list(fns))
    with pytest.raises(ValueError, match=r"name rewards \['typo'\] that are not computed"):
        check_reward_weights({"typo": 1.0}, list(fns))

    with pytest.raises(RewardFunctionError, match="'bad' returned 'yes', not a number"):
        evaluate_rewards({"bad": lambda p, c, pi, ci: "yes"}, "", "", [], [])
    with pytest.raises(RewardFunctionError, match="'nan' returned a non-finite reward"):
        evaluate_rewards({"nan": lambda p, c, pi, ci: float("nan")}, "", "", [], [])
    with pytest.raises(RewardFunctionError, match="'boom' raised ZeroDivisionError"):
        evaluate_rewards({"boom": lambda p, c, pi, ci: 1 / 0}, "", "", [], [])
    with pytest.raises(RewardFunctionError, match="'short' must take"):
        evaluate_rewards({"short": lambda completion: 1.0}, "", "", [], [])

    async def judge(prompt, completion, prompt_ids, completion_ids):
        await asyncio.sleep(0)
        return 0.25

    with pytest.raises(RewardFunctionError, match="is async; use aevaluate_rewards"):
        evaluate_rewards({"judge": judge}, "", "", [], [])
    assert asyncio.run(aevaluate_rewards({"judge": judge, "exact": exact_match}, "", "a", [], [], {"answer": "a"})) == {
        "judge": 0.25,
        "exact": 1.0,
    }


def test_running_sum_rewards_each_turn_and_restates_the_true_total():
    """Answers right, wrong, right: per-turn rewards 1, 0, 1; the user's next message starts from the true total
    whatever the policy said; the episode ends after num_terms - 1 turns. The demonstrations follow the same turns."""
    from marin_rl.envs.multi_turn import Conversation
    from marin_rl.envs.running_sum import RunningSumEnvironment
    from marin_rl.inference.client import Sample

    tok = build_char_tokenizer()
    env = RunningSumEnvironment(tok, num_terms=4, num_train=50, num_eval=10)
    problem = env.train_problems()[0]
    terms, totals = problem.fields["terms"], problem.fields["totals"]
    assert problem.prompt == f"{terms[0]}+{terms[1]}=" and totals == [sum(terms[: i + 2]) for i in range(3)]
    conv: Conversation = env.new_conversation(problem)
    sampling = SamplingParams(temperature=1.0, max_tokens=5)
    answers, replies, rewards = [totals[0], totals[1] + 1, totals[2]], [], []
    for answer in answers:
        ids = tok(str(answer), add_special_tokens=False)["input_ids"] + conv.stop_token_ids[:1]
        conv.add_policy_turn(Sample(ids, [-1.0] * len(ids), str(answer), "stop", 0, 0, "s", 0.0), sampling)
        messages, reward = asyncio.run(env.env_response(problem, conv))
        rewards.append(reward["correct"])
        if messages is None:
            break
        replies.append(messages[0]["content"])
        conv.add_messages(messages)
    assert rewards == [1.0, 0.0, 1.0] and len(replies) == 2
    assert replies == [f"{totals[0]}+{terms[2]}=", f"{totals[1]}+{terms[3]}="]  # the true totals, not the policy's
    demo = env.reference_messages(problem)
    assert [m["content"] for m in demo] == [str(totals[0]), replies[0], str(totals[1]), replies[1], str(totals[2])]
