"""Reward models: checkpoints, the reward server against an in-process forward pass, bad requests, the client,
environments with a model reward (single- and multi-turn), config validation, the graph, the training program, and
an RL run trained on a reward model's reward alone."""

import asyncio
import dataclasses
import json
import math
from pathlib import Path

import equinox as eqx
import haliax as hax
import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl.config import RunConfig, parse_config
from marin_rl.envs.arithmetic import AdditionEnvironment
from marin_rl.envs.base import Problem, SamplingParams, run_groups
from marin_rl.envs.model_rewards import attach_reward_models, model_reward_function
from marin_rl.envs.multi_turn import EnvResponse, MultiTurnEnvironment
from marin_rl.frozen import thaw
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig, RewardModelConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.inference.reward_server import RewardClient, RewardRequestError, RewardServer
from marin_rl.learner.algorithm import get_algorithm, with_reward_models
from marin_rl.model.build import build_model
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.model.reward import (
    RewardModelSpec,
    load_reward_model,
    new_reward_model,
    read_reward_model_spec,
    save_reward_model,
    with_extra_layers,
)
from marin_rl.tokenizer import build_char_tokenizer

MAX_SEQ_LEN = 64


def _random_head(model, seed=1):
    """A reward model whose head is not zero (a new one scores every sequence 0)."""
    weight = hax.random.normal(jax.random.PRNGKey(seed), model.head.weight.axes) * 0.3
    return eqx.tree_at(lambda m: (m.head.weight, m.head.bias), model, (weight, model.head.bias + 0.1))


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    """A saved reward model (the quickstart's trunk, random weights, a non-zero head) and the model itself."""
    config = ModelConfig(architecture=dataclasses.replace(tiny_llama(), max_seq_len=MAX_SEQ_LEN))
    model = _random_head(new_reward_model(config, len(tokenizer)))
    path = str(tmp_path_factory.mktemp("rm") / "checkpoint")
    save_reward_model(model, RewardModelSpec(model=config, vocab_size=len(tokenizer), info={"note": "test"}), path)
    return path, model


def _reference_score(model, ids: list[int]) -> float:
    """The reward of one sequence by a plain forward pass of its tokens alone (no padding, no batching)."""
    Batch, Pos = hax.Axis("batch", 1), hax.Axis("position", len(ids))
    x = hax.named(jnp.asarray([ids], dtype=jnp.int32), (Batch, Pos))
    values = model.hidden_values(x, hax.broadcast_to(hax.arange(Pos), x.axes), hax.zeros(x.axes, dtype=jnp.int32))
    return float(jax.nn.sigmoid(values.array[0, -1]))


@pytest.fixture(scope="module")
def reward_server(checkpoint):
    path, model = checkpoint
    config = RewardModelConfig(name="rm", path=path, max_batch_rows=8, batch_timeout_s=0.05)
    server = RewardServer.from_checkpoint(config)
    address = server.start()
    yield server, address, model
    server.stop()


# ---- checkpoints -------------------------------------------------------------------------------------------------
def test_checkpoint_round_trip_locally_and_through_fsspec(checkpoint, tokenizer):
    path, model = checkpoint
    for where in (path, "memory://marin_rl_test/rm"):
        if where != path:
            save_reward_model(model, read_reward_model_spec(path), where)
        loaded, spec = load_reward_model(where)
        assert spec.vocab_size == len(tokenizer) and spec.output == "sigmoid" and spec.info == {"note": "test"}
        assert spec.model.architecture == dataclasses.replace(tiny_llama(), max_seq_len=MAX_SEQ_LEN)
        ours = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
        theirs = jax.tree_util.tree_leaves(eqx.filter(loaded, eqx.is_array))
        assert len(ours) == len(theirs) and all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_missing_incomplete_or_mismatched_checkpoints_are_refused(checkpoint, tmp_path):
    path, model = checkpoint
    with pytest.raises(FileNotFoundError, match="no reward_model.json"):
        load_reward_model(str(tmp_path / "nothing"))
    partial = tmp_path / "partial"  # the weights written, the spec (the completion marker) not
    partial.mkdir()
    (partial / "weights.eqx").write_bytes((Path(path) / "weights.eqx").read_bytes())
    with pytest.raises(FileNotFoundError, match="no reward_model.json"):
        load_reward_model(str(partial))
    wrong = tmp_path / "wrong"  # a spec naming a wider model than the weights hold
    spec = read_reward_model_spec(path)
    wide = dataclasses.replace(spec.model, architecture=dataclasses.replace(spec.model.architecture, hidden_dim=64))
    save_reward_model(model, spec, str(wrong))
    (wrong / "reward_model.json").write_text(
        json.dumps({**json.loads((wrong / "reward_model.json").read_text()), "model": _encode(wide)})
    )
    with pytest.raises(ValueError, match="weights.eqx"):
        load_reward_model(str(wrong))


def _encode(model_config):
    import draccus

    return draccus.encode(model_config)


def test_extra_layers_keep_the_trunk_and_add_fresh_layers(tokenizer):
    config = ModelConfig(architecture=dataclasses.replace(tiny_llama(), max_seq_len=MAX_SEQ_LEN))
    lm = build_model(config, len(tokenizer))
    bigger, bigger_config = with_extra_layers(lm, config, 1)
    assert bigger_config.architecture.num_layers == 3
    q_old = lm.transformer.layers.stacked.self_attn.q_proj.weight.array
    q_new = bigger.transformer.layers.stacked.self_attn.q_proj.weight.array
    assert q_new.shape[0] == 3 and np.array_equal(q_new[:2], q_old) and not np.allclose(q_new[2], q_old[1])
    assert np.array_equal(bigger.embeddings.token_embeddings.weight.array, lm.embeddings.token_embeddings.weight.array)


# ---- the server --------------------------------------------------------------------------------------------------
def test_server_scores_equal_an_in_process_forward_pass_under_concurrent_batched_requests(reward_server):
    server, address, model = reward_server
    rng = np.random.default_rng(0)
    vocab = server.vocab_size
    requests = []  # 6 requests of 1-3 items, 1 to 64 tokens each: several length buckets, padded rows
    for n_items in (1, 3, 2, 1, 3, 2):
        items = []
        for _ in range(n_items):
            n = int(rng.integers(1, MAX_SEQ_LEN + 1))
            split = int(rng.integers(0, n + 1))
            ids = rng.integers(0, vocab, n).tolist()
            items.append((ids[:split], ids[split:]))
        requests.append(items)
    client = RewardClient([address], name="rm")
    before = dict(server.counters)

    async def all_at_once():
        try:
            return await asyncio.gather(*(client.score(items) for items in requests))
        finally:
            await client.aclose()

    answers = asyncio.run(all_at_once())
    for items, rewards in zip(requests, answers, strict=True):
        assert len(rewards) == len(items)
        for (prompt, completion), reward in zip(items, rewards, strict=True):
            assert reward == pytest.approx(_reference_score(model, prompt + completion), abs=1e-5)
    calls = server.counters["device_calls"] - before["device_calls"]
    assert server.counters["items"] - before["items"] == sum(len(r) for r in requests) == 12
    assert server.counters["batches"] - before["batches"] < len(requests), "concurrent requests share a batch"
    assert calls < 12, "items of several requests share device calls"
    assert {rows for rows, _ in server.shapes} <= set(server.row_buckets)
    assert {length for _, length in server.shapes} <= set(server.length_buckets) == {16, 32, 64}


def test_bad_requests_are_400s_naming_the_problem(reward_server):
    server, address, _ = reward_server
    url = f"http://{address}/v1/rewards"
    too_long = list(range(1, 40)), list(range(1, 30))
    cases = [
        ({"items": []}, "at least one item"),
        (
            {"items": [{"prompt_ids": [1, 2], "completion_ids": [3]}, {"prompt_ids": [], "completion_ids": []}]},
            "items[1]: empty sequence",
        ),
        (
            {"items": [{"prompt_ids": too_long[0], "completion_ids": too_long[1]}]},
            "items[0]: 68 tokens exceed the reward model's max_seq_len=64",
        ),
        (
            {"items": [{"prompt_ids": [1, 2], "completion_ids": [server.vocab_size]}]},
            f"items[0]: token id {server.vocab_size} at position 2 is outside the reward model's vocabulary",
        ),
        ({"items": [{"prompt_ids": [-1], "completion_ids": [2]}]}, "token id -1 at position 0 is outside"),
        ({"items": "three"}, "malformed request: body.items"),
        ({"sequences": [[1, 2]]}, "malformed request: body.items: Field required"),
    ]
    for body, message in cases:
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert message in r.json()["detail"], (message, r.json())
    health = httpx.get(f"http://{address}/health", timeout=30).json()
    assert health == {"status": "healthy", "model": "rm", "max_seq_len": 64, "vocab_size": server.vocab_size}


def test_client_coalesces_a_groups_items_and_gives_each_caller_its_own_error(reward_server):
    server, address, model = reward_server
    client = RewardClient([address], name="rm")
    items = [([5, 6, 7], [8 + k]) for k in range(5)]

    async def group(bad_at=None):
        calls = [client.score_one(p, c if k != bad_at else [server.vocab_size + 3]) for k, (p, c) in enumerate(items)]
        return await asyncio.gather(*calls, return_exceptions=True)

    async def run():
        try:
            first = await group()
            requests = client.requests
            second = await group(bad_at=2)
            return first, requests, second
        finally:
            await client.aclose()

    first, requests, second = asyncio.run(run())
    assert requests == 1, "the five concurrent items travel in one request"
    assert first == pytest.approx([_reference_score(model, p + c) for p, c in items], abs=1e-5)
    assert isinstance(second[2], RewardRequestError) and "outside the reward model's vocabulary" in str(second[2])
    assert [v for k, v in enumerate(second) if k != 2] == pytest.approx([first[k] for k in (0, 1, 3, 4)], abs=1e-5)


# ---- environments with a model reward ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy_server(tokenizer):
    model = build_model(
        ModelConfig(architecture=dataclasses.replace(tiny_llama(), max_seq_len=MAX_SEQ_LEN)), len(tokenizer)
    )
    config = InferenceConfig(
        max_seqs=16, max_seq_len=MAX_SEQ_LEN, levanter=LevanterServerConfig(page_size=16, prefill_tokens=1024)
    )
    server = LevanterInferenceServer(model, tokenizer, config)
    server.apply_weights(0, [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))])
    address = server.start()
    yield address
    server.stop()


def test_single_turn_environment_with_a_model_reward(tokenizer, reward_server, policy_server):
    _, address, model = reward_server
    env = AdditionEnvironment(tokenizer, max_operand=9, num_eval=5, reward_weights={"correct": 0.5, "rm": 2.0})
    client = RewardClient([address], name="rm")
    attach_reward_models(env, {"rm": client})
    with pytest.raises(ValueError, match="already computed"):
        env.add_reward_functions({"rm": model_reward_function(client)})
    sampling = SamplingParams(temperature=1.0, max_tokens=4)
    groups = asyncio.run(run_groups(env, [policy_server], env.train_problems()[:3], 4, sampling))
    for problem, group in zip(env.train_problems()[:3], groups, strict=True):
        for rollout in group.rollouts:
            prompt, sampled = rollout.turns
            expected = _reference_score(model, prompt.token_ids + sampled.token_ids)
            correct = float(sampled.message.strip() == problem.answer)
            assert sampled.rewards["correct"] == correct
            assert sampled.rewards["rm"] == pytest.approx(expected, abs=1e-5)
            assert sampled.reward == pytest.approx(0.5 * correct + 2.0 * sampled.rewards["rm"])
            assert rollout.reward == pytest.approx(sampled.reward)


def test_evaluation_of_a_run_trained_on_a_model_reward_reports_the_verifiers_score(
    tokenizer, reward_server, policy_server
):
    from marin_rl.rollouts.worker import RolloutWorker

    _, address, _ = reward_server
    env = AdditionEnvironment(tokenizer, max_operand=9, num_eval=6, reward_weights={"correct": 0.0, "rm": 1.0})
    assert env.verifier_weights() == {"correct": 1.0}  # the class's own verifier, whatever the run trains on
    attach_reward_models(env, {"rm": RewardClient([address], name="rm")})
    worker = RolloutWorker([policy_server])

    async def evaluate():
        try:
            return await worker.evaluate(env, env.eval_problems(), 3, SamplingParams(temperature=1.0, max_tokens=4))
        finally:
            await worker.aclose()

    m = asyncio.run(evaluate())
    assert m["reward"] == pytest.approx(m["rewards/rm"]) and m["reward"] > 0  # trained on: the model's score
    assert m["verifier_reward"] == pytest.approx(m["rewards/correct"])
    assert m["pass@1"] == pytest.approx(m["verifier_reward"])  # a 0/1 verifier: pass@1 is its accuracy
    assert 0.0 <= m["verifier_greedy_reward"] <= 1.0
    plain = AdditionEnvironment(tokenizer, max_operand=9, num_eval=6)  # no model reward: no verifier keys
    worker = RolloutWorker([policy_server])

    async def evaluate_plain():
        try:
            return await worker.evaluate(plain, plain.eval_problems(), 2, SamplingParams(temperature=1.0, max_tokens=4))
        finally:
            await worker.aclose()

    assert "verifier_reward" not in asyncio.run(evaluate_plain())


class TwoTurns(MultiTurnEnvironment):
    """Asks once more after the first answer, then ends; 'turns' rewards each policy turn."""

    reward_weights = {"turns": 1.0, "rm": -1.0}

    def train_problems(self):
        return [Problem(id="p0", prompt="Count:", answer="1")]

    def eval_problems(self):
        return self.train_problems()

    async def env_response(self, problem, conversation):
        if len(conversation.policy_turns) >= 2:
            return EnvResponse(None, {"turns": 1.0})
        return EnvResponse([{"role": "user", "content": "more"}], {"turns": 1.0})


def test_multi_turn_environment_scores_the_whole_episode_with_the_model(tokenizer, reward_server, policy_server):
    _, address, model = reward_server
    env = TwoTurns(tokenizer, name="two", max_episode_tokens=MAX_SEQ_LEN)
    attach_reward_models(env, {"rm": RewardClient([address], name="rm")})
    sampling = SamplingParams(temperature=1.0, max_tokens=6)
    [group] = asyncio.run(run_groups(env, [policy_server], env.train_problems(), 2, sampling))
    for rollout in group.rollouts:
        last = rollout.turns[-1] if rollout.turns[-1].is_sampled else [t for t in rollout.turns if t.is_sampled][-1]
        score = _reference_score(model, rollout.token_ids)  # prompt + every later turn, exact ids
        assert last.rewards["rm"] == pytest.approx(score, abs=1e-5)
        assert rollout.metadata["episode_rewards"]["rm"] == pytest.approx(score, abs=1e-5)
        assert rollout.reward == pytest.approx(len([t for t in rollout.turns if t.is_sampled]) - last.rewards["rm"])


def test_inference_engine_local_serves_the_runs_reward_models_in_process(tmp_path, checkpoint, tokenizer):
    from marin_rl.api import EngineConfig, InferenceEngine
    from marin_rl.config import make_environment

    path, model = checkpoint
    config = thaw(
        parse_config(
            [
                "--config",
                "experiments/quickstart_reward_model.yaml",
                "--inference.max_seqs",
                "16",
                "--inference.levanter.prefill_tokens",
                "256",
            ]
        )
    )
    config.reward_models[0].path = path
    config.envs[0].args = {"max_operand": 9, "num_eval": 5, "reward_weights": {"correct": 1.0, "rm": 0.5}}
    env = make_environment(config.envs[0], tokenizer, seed=0)
    sampling = SamplingParams(temperature=1.0, max_tokens=4)
    with InferenceEngine.local(config, EngineConfig(group_size=2, sampling=sampling), tokenizer=tokenizer) as engine:
        assert list(engine.rewards.clients) == ["rm"] and len(engine.rewards.servers) == 1
        engine.attach_reward_models(env)  # the models its config entry names: ['rm']
        groups = engine.rollout_batch(env.eval_problems()[:3], env)
        for group in groups:
            for rollout in group.rollouts:
                prompt, sampled = rollout.turns
                score = _reference_score(model, prompt.token_ids + sampled.token_ids)
                assert sampled.rewards["rm"] == pytest.approx(score, abs=1e-5)
                assert sampled.reward == pytest.approx(sampled.rewards["correct"] + 0.5 * sampled.rewards["rm"])
        metrics = engine.evaluate(env, env.eval_problems()[:3], samples_per_problem=2)
        assert 0 <= metrics["rewards/correct"] <= 1 and 0 < metrics["rewards/rm"] < 1
        assert metrics["reward"] == pytest.approx(metrics["rewards/correct"] + 0.5 * metrics["rewards/rm"])
        with pytest.raises(KeyError, match=r"no reward servers for \['judge'\]"):
            engine.attach_reward_models(env, ["judge"])


# ---- configuration and the graph ---------------------------------------------------------------------------------
def _config(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


BASE = """
envs:
  - name: addition
    args: {max_operand: 9, num_eval: 5, reward_weights: {correct: 0.0, rm: 1.0}}
    reward_models: [rm]
reward_models:
  - {name: rm, path: /somewhere/checkpoint}
"""


@pytest.mark.parametrize(
    "text, message",
    [
        (
            BASE.replace("reward_models: [rm]", "reward_models: [judge]"),
            r"envs\[addition\].reward_models names \['judge'\], which are not in reward_models \(known: \['rm'\]\)",
        ),
        (
            BASE.replace(", reward_weights: {correct: 0.0, rm: 1.0}", ""),
            r"envs\[addition\] uses reward models \['rm'\] but its reward_weights \{'correct': 1.0\} "
            r"give them no weight",
        ),
        (BASE.replace("path: /somewhere/checkpoint", "path: ''"), r"reward_models\[rm\].path: the checkpoint"),
        (BASE + "  - {name: rm, path: /elsewhere}\n", r"reward_models: names must be unique"),
        (BASE + "  - {name: spare, path: /elsewhere}\n", r"reward_models \['spare'\] are used by no environment"),
        (BASE.replace("{name: rm,", "{name: rm, num_servers: 0,"), r"reward_models\[0\]\.num_servers: must be >= 1"),
    ],
)
def test_config_validation_names_the_unknown_model_or_the_missing_weight(tmp_path, text, message):
    with pytest.raises(SystemExit, match=message):
        parse_config(["--config", _config(tmp_path, text)])


@pytest.mark.slow
def test_a_local_backend_run_scores_every_rollout_with_its_reward_model_in_process(tmp_path, checkpoint):
    """experiments/quickstart_reward_model.yaml on the local backend (no Ray), a few steps: the reward model's server
    runs in the learner's process, every persisted rollout carries the model's reward, equal to a plain forward pass
    of the reward model over its tokens, and the run trains on it."""
    from marin_rl.replay.store import read_rollouts
    from marin_rl.run import run

    path, model = checkpoint
    out = tmp_path / "run"
    config = thaw(
        parse_config(
            [
                "--config",
                "experiments/quickstart_reward_model.yaml",
                "--output_dir",
                str(out),
                "--orchestrator.backend",
                "local",
                "--learner.warm_start.steps",
                "0",
                "--orchestrator.num_steps",
                "3",
                "--orchestrator.eval_every",
                "0",
                "--checkpoint.every",
                "0",
            ]
        )
    )  # changed below
    config.reward_models[0].path = path
    assert run(config)["steps"] == 3
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "learner/loss" in r]) == 3
    stored = read_rollouts(str(out / "rollouts" / "addition")).rollouts
    assert stored
    for s in stored[:24]:
        prompt, sampled = s.rollout.turns
        expected = _reference_score(model, prompt.token_ids + sampled.token_ids)
        assert sampled.rewards["rm"] == pytest.approx(expected, abs=1e-5)
        assert sampled.reward == pytest.approx(sampled.rewards["rm"])  # 'correct' has weight 0


def test_the_local_backend_serves_reward_models_on_one_host_and_refuses_them_on_several():
    config = thaw(
        parse_config(["--config", "experiments/quickstart_reward_model.yaml", "--orchestrator.backend", "local"])
    )
    config.validate()
    config.learner.hosts = 2
    with pytest.raises(ValueError, match="does not serve reward models yet") as e:
        config.validate()
    assert "\n" not in str(e.value)


def test_a_run_with_reward_models_has_a_reward_inf_call_in_its_graph(tmp_path):
    config = parse_config(["--config", _config(tmp_path, BASE)])
    assert config.envs[0].reward_models == ["rm"] and config.reward_models[0].path == "/somewhere/checkpoint"
    algorithm = config.algorithm()
    calls = {c.name: c for c in algorithm.ordered()}
    assert [c.name for c in algorithm.ordered()] == ["actor_generate", "reward_inf", "rloo_advantages", "actor_train"]
    assert (calls["reward_inf"].role, calls["reward_inf"].kind, calls["reward_inf"].side) == (
        "reward",
        "inference",
        "rollout",
    )
    assert calls["reward_inf"].reads == ("rollouts",) and calls["reward_inf"].writes == ("model_rewards",)
    assert "model_rewards" in calls["rloo_advantages"].reads and algorithm.roles == ("actor", "reward")
    assert algorithm.reward_models == ("rm",)
    assert RunConfig().algorithm() == get_algorithm("rloo"), "no reward models: the graph is unchanged"
    # PPO: GAE reads per-token rewards on the learner; the model's rewards reach them through the replay side
    ppo = with_reward_models(get_algorithm("ppo"), ["rm"])
    order = [c.name for c in ppo.ordered()]
    assert order.index("reward_inf") < order.index("reward_credit") < order.index("gae")
    assert [c.name for c in ppo.learner_calls()] == ["critic_inf", "gae", "actor_train", "critic_train"]


def test_graph_program_draws_the_reward_call(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "marin_rl.graph",
            "--config",
            "experiments/quickstart_reward_model.yaml",
            "--output",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "reward_inf         reward  inference rollout  reads rollouts -> writes model_rewards" in out
    assert '"reward_inf" -> "key:model_rewards";' in (tmp_path / "rloo+rm.dot").read_text()
    assert (tmp_path / "rloo+rm.png").stat().st_size > 10_000


# ---- the training program ----------------------------------------------------------------------------------------
def test_labels_are_the_verifiers_and_corruptions_look_like_policy_mistakes(tokenizer):
    import random

    from marin_rl.programs.reward_model import ExampleBuilder, RewardModelTrainConfig, corrupt

    rng = random.Random(0)
    assert {corrupt("47", "off_by_1", rng, []) for _ in range(50)} == {"46", "48"}
    assert {corrupt("47", "off_by_10", rng, []) for _ in range(50)} == {"37", "57"}
    assert corrupt("x7", "random", rng, []) is None and corrupt("abc", "edit", rng, []) != "abc"
    config = RewardModelTrainConfig(negatives_per_problem=3, corruptions=["off_by_1", "random"])
    env = AdditionEnvironment(tokenizer, max_operand=9, num_eval=5)
    builder = ExampleBuilder(env, tokenizer, config)
    problems = env.train_problems()[:20]
    examples = builder.build(problems, builder.references(problems), rng)
    assert len(examples) == 20 * 4
    for ex in examples:
        text = tokenizer.decode(ex.completion_ids, skip_special_tokens=True)
        problem = next(p for p in problems if p.id == ex.problem_id)
        assert ex.label == float(text == problem.answer), "labelled by the environment's verifier"
        assert ex.completion_ids[-1] == tokenizer.eos_token_id
        assert len(ex.prefix_labels) == len(ex.completion_ids) - 1
    references = [e for e in examples if e.kind == "reference"]
    assert len(references) == 20 and all(e.label == 1.0 for e in references)
    # an unreliable demonstrator's slipped reference is labelled wrong, and gives no per-token labels
    noisy = AdditionEnvironment(tokenizer, max_operand=9, num_eval=5, demo_error_rate=0.5)
    builder = ExampleBuilder(noisy, tokenizer, config)
    examples = builder.build(problems, builder.references(problems), rng)
    slipped = {e.problem_id for e in examples if e.kind == "reference" and e.label == 0.0}
    assert 3 <= len(slipped) <= 17
    for ex in examples:
        assert (ex.prefix_labels == [] and ex.reference_ids == []) == (ex.problem_id in slipped)


# ---- end to end --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_rl_on_the_reward_models_reward_alone_raises_the_verifiers_held_out_correctness(tmp_path):
    """The README's two commands, the RL run shortened: train the addition reward model, then the quickstart whose
    only training reward is the model's (the verifier's 'correct' has weight 0 and is only evaluated)."""
    from marin_rl.programs.reward_model import parse_config as parse_rm_config
    from marin_rl.programs.reward_model import train_reward_model
    from marin_rl.run import run

    rm = train_reward_model(
        parse_rm_config(["--config", "experiments/addition_reward_model.yaml", "--output_dir", str(tmp_path / "rm")])
    )
    assert rm["eval_before"]["auc"] == 0.5  # a zero head scores everything alike
    assert rm["eval"]["accuracy"] >= 0.9, rm["eval"]  # 0.96 when measured
    assert rm["eval"]["auc"] >= 0.95, rm["eval"]  # 0.99 when measured
    assert json.loads((tmp_path / "rm" / "summary.json").read_text())["eval"] == rm["eval"]
    model, spec = load_reward_model(str(tmp_path / "rm" / "checkpoint"))
    assert spec.info["eval"] == rm["eval"] and spec.model.architecture.num_layers == 4  # + the 2 added layers
    assert math.isfinite(rm["train_seconds"])
    experiment = Path("experiments/quickstart_reward_model.yaml").read_text()
    assert "path: runs/addition_reward_model/checkpoint" in experiment
    config_path = tmp_path / "quickstart_reward_model.yaml"
    config_path.write_text(experiment.replace("runs/addition_reward_model/checkpoint", str(tmp_path / "rm/checkpoint")))
    out = tmp_path / "run"
    config = parse_config(
        [
            "--config",
            str(config_path),
            "--output_dir",
            str(out),
            "--orchestrator.num_steps",
            "60",
            "--orchestrator.eval_every",
            "30",
            "--orchestrator.num_cpus",
            "2",
            "--checkpoint.every",
            "0",
        ]
    )
    assert config.envs[0].args["reward_weights"] == {"correct": 0.0, "rm": 1.0}
    summary = run(config)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/addition/rewards/correct" in r]
    assert [r["step"] for r in evals] == [0, 30, 60]
    for r in evals:  # the reward trained on is the model's alone: weight 1 on 'rm', 0 on the verifier's 'correct'
        assert r["eval/addition/reward"] == pytest.approx(r["eval/addition/rewards/rm"])
    before, after = evals[0]["eval/addition/rewards/correct"], evals[-1]["eval/addition/rewards/correct"]
    assert after - before >= 0.12, (before, after)  # measured: 0.444 -> 0.643 (100 steps: 0.495 -> 0.733)
    assert summary["eval_reward_end"] > summary["eval_reward_start"]
    # the headline is the verifier's held-out score; the reward model's score is kept as the trained-on reward
    assert summary["headline"] == {"addition": "eval/addition/verifier_reward"}
    assert summary["eval_reward_end"] == pytest.approx(after) and summary["eval_reward_start"] == pytest.approx(before)
    assert summary["eval_trained_reward_end"] == pytest.approx(evals[-1]["eval/addition/reward"])
