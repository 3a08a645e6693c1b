"""The locally built BPE tokenizer and its ChatML template: deterministic and cached builds, single-turn, multi-turn
and tool episodes whose ids are exactly the template's rendering, stop strings and stop tokens cut exactly on the
embedded server."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
import yaml
from transformers import PreTrainedTokenizerFast

from marin_rl.bpe import ENDOFTEXT, IM_END, IM_START, build_bpe_tokenizer, cache_key
from marin_rl.config import EnvConfig, make_environment
from marin_rl.envs.arithmetic import AdditionEnvironment
from marin_rl.envs.base import Problem, SamplingParams, reference_examples, run_groups
from marin_rl.envs.calculator import CalculatorEnvironment
from marin_rl.envs.multi_turn import EnvResponse, MultiTurnEnvironment
from marin_rl.inference.client import PolicyClient, Sample
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.model.build import build_model
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.replay.store import read_rollouts
from marin_rl.run import parse_config
from marin_rl.tokenizer import TokenizerConfig, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 1024
MAX_SEQ_LEN = 256


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_bpe_tokenizer(VOCAB, cache_dir=tmp_path_factory.mktemp("bpe"))


def _enc(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _render_ids(tok, messages, **kw) -> list[int]:
    ids = tok.apply_chat_template(messages, tokenize=True, **kw)
    return [int(t) for t in getattr(ids, "input_ids", ids)]


# ---- the build -----------------------------------------------------------------------------------------------------
def test_the_build_is_deterministic_cached_and_qwen_shaped(tok, tmp_path):
    again = build_bpe_tokenizer(VOCAB, cache_dir=tmp_path)  # a fresh build in another cache
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str(), "same inputs, same tokenizer"
    saved = tmp_path / cache_key(VOCAB) / "tokenizer.json"
    stamp = saved.stat().st_mtime_ns
    cached = build_bpe_tokenizer(VOCAB, cache_dir=tmp_path)
    assert saved.stat().st_mtime_ns == stamp and cached.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    assert len(tok) == VOCAB and tok.eos_token == IM_END and tok.pad_token == ENDOFTEXT and tok.bos_token is None
    assert [tok.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_START, IM_END)] == [0, 1, 2]
    assert set(tok.all_special_ids) == {0, 1, 2}
    # digits one by one (Qwen's pre-tokenizer), words merged, tool-call markers whole, any text round-trips
    assert [tok.decode([i]) for i in _enc(tok, "12+345=")] == list("12+345=")
    assert len(_enc(tok, "How many apples does Maya have now?")) < len("How many apples does Maya have now?") / 2
    assert tok.convert_ids_to_tokens(_enc(tok, "<tool_call>x</tool_call>")) == ["<tool_call>", "x", "</tool_call>"]
    for text in ("héllo wörld 😀 \t\n  x", "#### 72", '{"name": "calculate"}'):
        assert tok.decode(_enc(tok, text)) == text
    # a completion is decoded without its special tokens, the tool-call markers kept
    assert (
        tok.decode(_enc(tok, "<tool_call>7</tool_call>") + [2], skip_special_tokens=True) == "<tool_call>7</tool_call>"
    )


def test_the_tokenizer_config_builds_or_refuses(monkeypatch, tmp_path):
    monkeypatch.setenv("MARIN_RL_CACHE", str(tmp_path))
    loaded = load_tokenizer(TokenizerConfig(kind="bpe", vocab_size=VOCAB))
    assert len(loaded) == VOCAB and (tmp_path / "tokenizers" / cache_key(VOCAB) / "tokenizer.json").exists()
    args = ["--config", "experiments/quickstart_bpe.yaml"]
    for extra, message in [
        (["--tokenizer.kind", "wordpiece"], "tokenizer.kind must be one of ('char', 'bpe'), got 'wordpiece'"),
        (["--tokenizer.path", "/tmp/x"], "tokenizer.kind: 'bpe' builds a tokenizer, but tokenizer.path loads one"),
        (["--tokenizer.vocab_size", "100"], "tokenizer.vocab_size"),
    ]:
        with pytest.raises(SystemExit, match="marin_rl: invalid configuration: .*" + message.replace("(", r"\(")[:40]):
            parse_config(args + extra)
    raw = yaml.safe_load(open("experiments/quickstart_bpe.yaml"))
    raw["envs"][0].update(chat_template=False, system_prompt="Add.")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(SystemExit, match=r"envs\[addition\].system_prompt: a system message needs chat_template"):
        parse_config(["--config", str(tmp_path / "bad.yaml")])
    with pytest.raises(ValueError, match="at least 261"):
        build_bpe_tokenizer(100, cache_dir=tmp_path)


# ---- rendering ------------------------------------------------------------------------------------------------------
def test_single_turn_prompts_render_through_the_template_and_end_at_im_end(tok):
    config = EnvConfig(args={"max_operand": 9, "num_eval": 5}, chat_template=True, system_prompt="Add.")
    env = make_environment(config, tok, seed=0)
    problem = env.train_problems()[0]
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": problem.prompt}]
    assert env.encode_prompt(problem) == _render_ids(tok, messages, add_generation_prompt=True)
    text = tok.decode(env.encode_prompt(problem))
    assert (
        text
        == f"<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n{problem.prompt}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert env.stop_token_ids == [tok.eos_token_id] == [2]
    # warm start: the answer and the end of the turn, exactly the template's rendering of the whole exchange
    prompt, completion = reference_examples(env, tok)[0]
    whole = _render_ids(tok, messages + [{"role": "assistant", "content": problem.answer}])
    assert prompt + completion + _enc(tok, "\n") == whole
    # a tokenizer whose EOS is <|endoftext|> (Qwen base models) still ends an assistant turn at <|im_end|> first
    base = PreTrainedTokenizerFast(
        tokenizer_object=tok.backend_tokenizer, eos_token=ENDOFTEXT, additional_special_tokens=[IM_START, IM_END]
    )
    base.chat_template = tok.chat_template
    env = AdditionEnvironment(base, max_operand=9, num_eval=5)
    assert env.stop_token_ids == [0]
    env.use_chat_template()
    assert env.stop_token_ids == [2, 0]
    with pytest.raises(ValueError, match="envs\\[addition\\].chat_template: .* is not a single-turn environment"):
        make_environment(
            EnvConfig(env_class="marin_rl.envs.calculator:CalculatorEnvironment", chat_template=True), tok, 0
        )


class ScriptedPolicy:
    """Answers each request with the next scripted assistant message (canonical ids) closed by <|im_end|>, or cut
    off without it (finish 'length'); records the prompts and stop ids it was sent."""

    def __init__(self, tok, replies: list[str], closed: list[bool]):
        self.tok, self.replies, self.closed = tok, list(replies), list(closed)
        self.requests: list[tuple[list[int], list[int]]] = []

    async def sample(self, prompt_ids, *, n, max_tokens, temperature, stop_token_ids=None, **_):
        self.requests.append((list(prompt_ids), list(stop_token_ids or [])))
        text, closed = self.replies.pop(0), self.closed.pop(0)
        ids = _enc(self.tok, text) + ([self.tok.eos_token_id] if closed else [])
        return [Sample(ids, [-0.1] * len(ids), text, "stop" if closed else "length", 0, 0, "scripted", 0.0)]


@pytest.mark.parametrize("closed", [(True, True), (False, True)], ids=["im_end_sampled", "first_turn_cut_off"])
def test_a_tool_episode_is_token_for_token_the_templates_rendering(tok, closed):
    env = CalculatorEnvironment(tok, num_train=4, num_eval=2, system_prompt="Use the calculator.")
    problem = env.train_problems()[0]
    call, _, answer = env.reference_messages(problem)
    policy = ScriptedPolicy(tok, [call["content"], answer["content"]], list(closed))
    rollout = asyncio.run(env.run_episode(policy, problem, SamplingParams(max_tokens=64)))
    assert rollout.reward == 1.0 and [t.role for t in rollout.turns] == ["user", "assistant", "tool", "assistant"]
    messages = [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": problem.prompt},
        {"role": "assistant", "content": call["content"]},
        {"role": "tool", "content": rollout.turns[2].message},
        {"role": "assistant", "content": answer["content"]},
    ]
    whole = _render_ids(tok, messages, tools=env.tools_for_prompt())
    ids = [i for t in rollout.turns for i in t.token_ids]
    assert ids + _enc(tok, "\n") == whole, "the episode's ids are the template's rendering of its messages"
    shown = tok.decode(rollout.turns[0].token_ids)
    assert "# Tools" in shown and '"name": "calculate"' in shown, "the tool schemas are in the prompt"
    # each policy turn was asked for with exactly the ids before it, and stops at <|im_end|>
    for (prompt, stops), k in zip(policy.requests, (1, 3), strict=True):
        assert prompt == [i for t in rollout.turns[:k] for i in t.token_ids] and stops == [tok.eos_token_id]
    # the tool turn supplies the closing <|im_end|> only when the policy did not sample it
    env_turn = rollout.turns[2].token_ids
    assert (env_turn[0] == tok.eos_token_id) == (not closed[0])
    assert tok.decode(env_turn).startswith(("" if closed[0] else IM_END) + "\n<|im_start|>user\n<tool_response>\n")
    # the warm-start transcript has the same ids as the episode
    prompt_ids, completion_ids = reference_examples(env, tok)[0]
    if all(closed):
        assert prompt_ids + completion_ids == ids


# ---- on the embedded server ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tok):
    model = build_model(ModelConfig(architecture=dataclasses.replace(tiny_llama(), max_seq_len=MAX_SEQ_LEN)), len(tok))
    srv = LevanterInferenceServer(
        model,
        tok,
        InferenceConfig(
            max_seqs=16, max_seq_len=MAX_SEQ_LEN, levanter=LevanterServerConfig(page_size=16, prefill_tokens=1024)
        ),
    )
    srv.apply_weights(0, [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))])
    address = srv.start()
    yield address
    srv.stop()


def _sample(address, prompt, **kw):
    async def go():
        client = PolicyClient([address])
        try:
            return await client.sample(prompt, **kw)
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_stop_strings_and_stop_tokens_cut_exactly(tok, server):
    prompt = _render_ids(tok, [{"role": "user", "content": "12+34="}], add_generation_prompt=True)
    [free] = _sample(server, prompt, max_tokens=24, temperature=0.0)
    g = free.token_ids
    assert len(g) == 24 and free.finish_reason == "length"
    # a stop string: the text of 2-3 sampled tokens whose own tokenization is those tokens (the engine matches the
    # stop string's tokens); generation ends right after its first occurrence, the ids a prefix of the free run's
    windows = [
        (i, j)
        for i in range(1, len(g) - 3)
        for j in (i + 2, i + 3)
        if not set(g[i:j]) & set(tok.all_special_ids) and _enc(tok, tok.decode(g[i:j])) == g[i:j]
    ]
    assert windows, "no stop string candidate in the greedy sample"
    i, j = windows[0]
    stop, seq = tok.decode(g[i:j]), g[i:j]
    cut = next(k for k in range(1, len(g) + 1) if (prompt + g[:k])[-len(seq) :] == seq)
    [s] = _sample(server, prompt, max_tokens=24, temperature=0.0, stop=[stop])
    assert s.token_ids == g[:cut] and s.finish_reason == "stop"
    assert s.text == tok.decode(g[:cut], skip_special_tokens=True) and s.text.endswith(stop)
    np.testing.assert_allclose(s.sampler_logprobs, free.sampler_logprobs[:cut], atol=1e-6)
    # a stop token: the id is the last one returned (its first occurrence)
    target = g[5]
    [t] = _sample(server, prompt, max_tokens=24, temperature=0.0, stop_token_ids=[target])
    assert t.token_ids == g[: g.index(target) + 1] and t.finish_reason == "stop"


class ContinueEnvironment(MultiTurnEnvironment):
    """Replies 'continue n' to every policy turn."""

    name = "continue"

    def __init__(self, tokenizer, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.problems = [Problem(id=f"p{i}", prompt=f"Say {i}.", answer=str(i)) for i in range(2)]

    def train_problems(self):
        return self.problems

    def eval_problems(self):
        return self.problems

    async def env_response(self, problem, conversation):
        return EnvResponse([{"role": "user", "content": f"continue {len(conversation.policy_turns)}"}], {})


def test_a_sampled_multi_turn_episode_is_the_templates_rendering(tok, server):
    env = ContinueEnvironment(tok, max_turns=3, system_prompt="Be brief.")
    groups = asyncio.run(run_groups(env, [server], env.train_problems(), 3, SamplingParams(max_tokens=6)))
    rollouts = [r for g in groups for r in g.rollouts]
    assert len(rollouts) == 6
    for r in rollouts:
        r.validate(len(tok))
        # the rendered text of the episode: the template's, with each assistant turn's sampled tokens as its content
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Say {r.problem_id[1:]}."}]
        for turn in r.turns[1:]:
            if turn.is_sampled:
                ids = turn.token_ids[:-1] if turn.token_ids[-1] == tok.eos_token_id else turn.token_ids
                messages.append({"role": "assistant", "content": tok.decode(ids)})
                assert turn.message == tok.decode(ids, skip_special_tokens=True)
                # the turn ends at its first <|im_end|>, and exactly when it was sampled
                assert (tok.eos_token_id in turn.token_ids) == (turn.inference_metadata.finish_reason == "stop")
                assert tok.eos_token_id not in turn.token_ids[:-1]
            else:
                messages.append({"role": "user", "content": turn.message})
        rendered = tok.apply_chat_template(messages, tokenize=False)
        text = tok.decode([i for t in r.turns for i in t.token_ids])
        closed = r.turns[-1].token_ids[-1] == tok.eos_token_id
        assert text + ("\n" if closed else "<|im_end|>\n") == rendered
        # environment turns are tokenized on their own: their ids are exactly the canonical ones of their text
        for turn in r.turns:
            if not turn.is_sampled:
                assert turn.token_ids == _enc(tok, tok.decode(turn.token_ids))


# ---- the quickstart through the BPE tokenizer ----------------------------------------------------------------------
@pytest.mark.slow
def test_the_quickstart_learns_through_the_bpe_tokenizer_and_chat_template(tmp_path):
    """experiments/quickstart_bpe.yaml as shipped (local backend): held-out reward over its last two evaluations is
    at least 0.25 above the start (measured: +0.342, +0.340), every prompt is the chat template's rendering and every
    answer that stopped ends with the <|im_end|> it sampled."""
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    config = str(ROOT / "experiments" / "quickstart_bpe.yaml")
    with open(log, "wb") as f:
        done = subprocess.run(
            [sys.executable, "-m", "marin_rl.run", "--config", config, "--output_dir", str(out)],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=3000,
        )
    assert done.returncode == 0, log.read_text()[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    print(f"quickstart_bpe: held-out reward {summary['eval_reward_start']:.3f} -> {summary['eval_reward_end']:.3f}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/mean_reward"] for r in rows if "eval/mean_reward" in r]
    # the mean of the last two: one evaluation (200 problems × 4 samples) moves by a few hundredths between neighbours
    assert (evals[-1] + evals[-2]) / 2 - evals[0] >= 0.25, evals
    tok = load_tokenizer(TokenizerConfig(kind="bpe", vocab_size=VOCAB))
    stored = read_rollouts(str(out / "rollouts" / "addition")).rollouts
    assert stored
    for s in stored[:2000]:
        prompt, turn = s.rollout.turns
        assert prompt.token_ids == _render_ids(
            tok, [{"role": "user", "content": prompt.message}], add_generation_prompt=True
        )
        stopped = turn.inference_metadata.finish_reason == "stop"
        assert (turn.token_ids[-1] == tok.eos_token_id) == stopped and tok.eos_token_id not in turn.token_ids[:-1]
    on_policy = [r for r in rows if r.get("batches/staleness/max") == 0 and "learner/logprob_diff_sampler/max_abs" in r]
    assert on_policy and all(r["learner/logprob_diff_sampler/max_abs"] < 1e-4 for r in on_policy)
