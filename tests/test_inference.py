"""The embedded server against the learner: token-exact samples, matching logprobs, versions, no recompiles,
partial rollouts (weights swapped between decode segments)."""

import asyncio
import threading
import time

import equinox as eqx
import haliax as hax
import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin_rl.envs.arithmetic import AdditionEnvironment
from marin_rl.envs.base import SamplingParams, run_groups
from marin_rl.inference.client import PolicyClient, versions_from_spans
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.learner.config import LearnerConfig, WarmStartConfig
from marin_rl.learner.learner import Learner
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.model.logprobs import token_logprobs
from marin_rl.replay.batcher import Batcher, BatcherConfig
from marin_rl.replay.buffer import ReplayBuffer, ReplayConfig
from marin_rl.replay.packing import Sequence, pack
from marin_rl.tokenizer import build_char_tokenizer
from marin_rl.types import InferenceMetadata, Rollout, RolloutGroup, Turn

SEGMENT = 4  # the test server decodes in segments of 4 tokens, so 5-token samples already span two


@pytest.fixture(scope="module")
def setup():
    tok = build_char_tokenizer()
    env = AdditionEnvironment(tok, max_operand=49, num_eval=50)
    arch = tiny_llama()
    learner = Learner(ModelConfig(architecture=arch), LearnerConfig(warm_start=WarmStartConfig(steps=30)), len(tok))
    examples = [(env.encode_prompt(p), tok(p.answer)["input_ids"] + [tok.eos_token_id]) for p in env.train_problems()]
    learner.warm_start(examples, 64)  # a policy that is not uniform, so logprobs vary
    server = LevanterInferenceServer(
        learner.model,
        tok,
        InferenceConfig(
            max_seqs=64,
            max_seq_len=64,
            levanter=LevanterServerConfig(page_size=16, prefill_tokens=512, segment_tokens=SEGMENT),
        ),
    )
    server.apply_weights(0, learner.weights())
    address = server.start()
    yield tok, env, learner, server, address
    server.stop()


def _sample_groups(env, address, problems, n, sampling):
    return asyncio.run(run_groups(env, [address], problems, n, sampling))


def test_server_logprobs_match_learner_on_packed_batch(setup):
    tok, env, learner, server, address = setup
    groups = _sample_groups(env, address, env.train_problems()[:48], 4, SamplingParams(temperature=1.0, max_tokens=5))
    rollouts = [r for g in groups for r in g.rollouts]
    batch, placed = pack([Sequence.from_rollout(r, 0.0) for r in rollouts], 48, 64)
    assert len(placed) == len(rollouts), "test batch should hold every rollout"
    last_segment = batch.segment_ids.max(axis=1)
    assert (last_segment[last_segment >= 0] >= 3).all(), "rows should be packed with several rollouts"
    learner_lp = learner.logprobs(batch)
    diff = np.abs(learner_lp - batch.sampler_logprobs)[batch.loss_mask]
    assert diff.size > 300  # 192 completions of 2-5 tokens (measured 562-960 over 25 draws)
    assert diff.max() <= 1e-4, f"sampler/learner logprob mismatch {diff.max()}"


def test_samples_are_token_exact_and_versioned(setup):
    tok, env, learner, server, address = setup
    groups = _sample_groups(env, address, env.train_problems()[:8], 4, SamplingParams(temperature=1.0, max_tokens=5))
    for g in groups:
        for r in g.rollouts:
            turn = r.turns[1]
            assert turn.inference_metadata.version_start == 0 == turn.inference_metadata.version_end
            assert turn.inference_metadata.token_versions == [0] * len(turn.token_ids)
            assert tok.decode(turn.token_ids, skip_special_tokens=True) == turn.message
            eos_at = [i for i, t in enumerate(turn.token_ids) if t == tok.eos_token_id]
            # generation stops at EOS (explicit stop token), and 'length' is reported only without it
            assert eos_at in ([], [len(turn.token_ids) - 1])
            assert (turn.inference_metadata.finish_reason == "length") == (not eos_at)


def test_concurrent_load_keeps_requests_apart(setup):
    """Many requests at once (more than one engine prefill) must not leak tokens between requests."""
    tok, env, learner, server, address = setup
    problems = env.train_problems()[:160]
    groups = _sample_groups(env, address, problems, 4, SamplingParams(temperature=1.0, max_tokens=5))
    rollouts = [r for g in groups for r in g.rollouts]
    assert all(len(r.turns[1].token_ids) <= 5 for r in rollouts)
    batch, placed = pack([Sequence.from_rollout(r, 0.0) for r in rollouts], 64, 64)
    diff = np.abs(learner.logprobs(batch) - batch.sampler_logprobs)[batch.loss_mask]
    assert diff.max() <= 1e-4


@pytest.mark.exclusive  # the update's wall-clock bound
def test_apply_weights_changes_outputs_and_version_without_recompiling(setup):
    tok, env, learner, server, address = setup
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    problems = env.train_problems()[:16]
    before = _sample_groups(env, address, problems, 1, greedy)
    compiles = []

    def listener(event, *args, **kwargs):
        if "compil" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        perturbed = [w + np.random.default_rng(0).normal(0, 0.2, w.shape).astype(w.dtype) for w in learner.weights()]
        start = time.time()
        server.apply_weights(7, perturbed)
        after = _sample_groups(env, address, problems, 1, greedy)
        elapsed = time.time() - start
    finally:
        jax.monitoring.clear_event_listeners()
    assert all(g.rollouts[0].turns[1].inference_metadata.version_start == 7 for g in after)
    assert all(set(g.rollouts[0].turns[1].inference_metadata.token_versions) == {7} for g in after)
    assert [g.rollouts[0].turns[1].token_ids for g in before] != [g.rollouts[0].turns[1].token_ids for g in after]
    assert not compiles, f"applying weights recompiled: {compiles[:3]}"
    assert elapsed < 5.0
    server.apply_weights(0, learner.weights())


def test_server_rejects_bad_requests(setup):
    tok, env, learner, server, address = setup
    import httpx

    r = httpx.post(f"http://{address}/v1/completions", json={"prompt": [5] * 80, "max_tokens": 4})
    assert r.status_code == 400 and "max_seq_len" in r.text
    r = httpx.post(f"http://{address}/v1/completions", json={"prompt": [5, 6], "max_tokens": 4, "top_p": 0.5})
    assert r.status_code == 400


def _complete(address, prompt, **kwargs):
    body = {"prompt": prompt, "logprobs": 0, "return_tokens_as_token_ids": True, **kwargs}
    r = httpx.post(f"http://{address}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    out = []
    for c in sorted(r.json()["choices"], key=lambda c: c["index"]):
        ids = [int(t.split(":")[1]) for t in c["logprobs"]["tokens"]]
        versions = versions_from_spans(c["policy_version_spans"], len(ids))
        out.append((ids, c["logprobs"]["token_logprobs"], c["policy_version_start"], c["policy_version_end"], versions))
    return out


def _model_with(model, leaves):
    params, static = eqx.partition(model, eqx.is_array)
    treedef = jax.tree_util.tree_structure(params)
    return eqx.combine(jax.tree_util.tree_unflatten(treedef, [jnp.asarray(x) for x in leaves]), static)


@eqx.filter_jit
def _logprobs_of(model, input_ids, position_ids, segment_ids):
    return token_logprobs(model, input_ids, position_ids, segment_ids)[0]


def _reference_logprobs(model, prompt, completions, row_len=64):
    """Learner-side logprob of every completion token: prompt + completion in row i, one forward pass."""
    rows = list(range(len(completions)))
    batch, _ = pack([Sequence.supervised(prompt, c) for c in completions], len(completions), row_len, assignment=rows)
    named = [hax.named(getattr(batch, k), ("batch", "position")) for k in ("input_ids", "position_ids", "segment_ids")]
    lp = np.asarray(_logprobs_of(model, *named).array)
    return [lp[r, len(prompt) : len(prompt) + len(c)] for r, c in enumerate(completions)]


def test_segmented_generation_samples_what_one_pass_samples(setup):
    """Continuing a sequence from prompt + tokens so far (same seed, same weights) changes nothing."""
    tok, env, learner, server, address = setup
    prompt = env.encode_prompt(env.train_problems()[0])
    segmented = _complete(address, prompt, n=4, max_tokens=14, temperature=1.0, seed=123)
    server.context.segment_tokens = None
    try:
        whole = _complete(address, prompt, n=4, max_tokens=14, temperature=1.0, seed=123)
    finally:
        server.context.segment_tokens = SEGMENT
    assert all(len(ids) == 14 for ids, *_ in segmented)  # no stop tokens: every sample spans 4 segments
    assert [ids for ids, *_ in segmented] == [ids for ids, *_ in whole]
    diff = np.abs(np.array([lp for _, lp, *_ in segmented]) - np.array([lp for _, lp, *_ in whole]))
    assert diff.max() <= 1e-5


def test_weights_swapped_mid_generation_continue_with_exact_logprobs(setup):
    """Partial rollouts: new weights arrive after the first segment; the rest is sampled (and scored) under them."""
    tok, env, learner, server, address = setup
    old = learner.weights()
    rng = np.random.default_rng(1)
    new = [w + rng.normal(0, 0.2, w.shape).astype(w.dtype) if w.dtype.kind == "f" else w for w in old]
    ctx = server.context
    first_segment_done = threading.Event()
    calls = []
    decode_segment = ctx._decode_segment

    def first_segment_then_wait_for_weights(seqs):
        joined = decode_segment(seqs)  # the sequences that joined the call (the dense engine's; here none)
        calls.append(len(seqs))
        if len(calls) == 1:
            first_segment_done.set()
            deadline = time.time() + 60
            while ctx._pending is None and time.time() < deadline:  # the update is on its way: swap it in next
                time.sleep(0.001)
        return joined

    def publish_new_weights():
        first_segment_done.wait(60)
        server.apply_weights(1, new)

    ctx._decode_segment = first_segment_then_wait_for_weights
    applier = threading.Thread(target=publish_new_weights)
    applier.start()
    prompt = env.encode_prompt(env.train_problems()[3])
    try:
        choices = _complete(address, prompt, n=6, max_tokens=15, temperature=1.0)
    finally:
        applier.join(60)
        del ctx._decode_segment
    try:
        assert server.version == 1
        straddling = [c for c in choices if c[2] == 0]
        assert straddling, "no choice started before the update"
        assert all(len(ids) == 15 for ids, *_ in choices)
        assert all(c[3] == 1 for c in choices), "every choice ended under the new weights"
        ref_old = _reference_logprobs(learner.model, prompt, [ids for ids, *_ in choices])
        ref_new = _reference_logprobs(_model_with(learner.model, new), prompt, [ids for ids, *_ in choices])
        for (_, lps, start, _, versions), lo, ln in zip(choices, ref_old, ref_new, strict=True):
            lps = np.asarray(lps)
            switch = SEGMENT if start == 0 else 0  # tokens sampled before the swap
            assert versions == [0] * switch + [1] * (15 - switch), "each token reports the version that sampled it"
            assert np.abs(lps[:switch] - lo[:switch]).max(initial=0) <= 1e-4
            assert np.abs(lps[switch:] - ln[switch:]).max() <= 1e-4
            # the check has teeth: the two policies disagree on these tokens
            assert np.abs(lps[switch:] - lo[switch:]).max() > 1e-2
            if switch:
                assert np.abs(lps[:switch] - ln[:switch]).max() > 1e-2

        # The replay and batching path takes such turns, and every trained token keeps the version that sampled it.
        rollouts = []
        for i, (ids, lps, start, end, versions) in enumerate(choices):
            meta = InferenceMetadata(
                server=address, version_start=start, version_end=end, token_versions=versions, finish_reason="length"
            )
            answer = Turn("assistant", "", ids, sampler_logprobs=list(lps), reward=i % 2, inference_metadata=meta)
            turns = [Turn("user", "", list(prompt)), answer]
            rollouts.append(Rollout("addition", "p3", turns))
        buffer = ReplayBuffer("addition", ReplayConfig(max_age=4), vocab_size=len(tok))
        assert buffer.admit(RolloutGroup("addition", "p3", rollouts), max_version=1).accepted
        batcher = Batcher(BatcherConfig(total_token_budget=3 * 64, max_seq_len=64, min_fill=0.5), {"addition": buffer})
        batch = batcher.try_make_batch(1).batch
        assert batch.loss_mask.sum() == 6 * 15
        assert sorted(batch.token_versions[batch.loss_mask].tolist()) == sorted(v for c in choices for v in c[4])
        assert (batch.token_versions[batch.loss_mask] == 0).sum() == SEGMENT * len(straddling)
    finally:
        server.apply_weights(0, old)


def test_versions_from_spans_accepts_every_version_and_rejects_gaps():
    assert versions_from_spans([{"version": -1, "start": 0, "end": 3}], 3) == [-1, -1, -1]
    spans = [{"version": 2, "start": 0, "end": 2}, {"version": 3, "start": 2, "end": 3}]
    assert versions_from_spans(spans, 3) == [2, 2, 3]
    assert versions_from_spans([], 0) == [] and versions_from_spans(None, 5) is None
    with pytest.raises(RuntimeError, match="do not cover"):
        versions_from_spans([{"version": 0, "start": 0, "end": 2}], 3)
    with pytest.raises(RuntimeError, match="reach outside"):
        versions_from_spans([{"version": 0, "start": 0, "end": 4}], 3)
    assert versions_from_spans(spans[::-1], 3) == [2, 2, 3]  # in any order
    with pytest.raises(RuntimeError, match="do not cover"):  # overlapping spans contradict each other
        versions_from_spans([{"version": 0, "start": 0, "end": 2}, {"version": 1, "start": 1, "end": 3}], 3)


def test_embedded_server_answers_integer_token_ids_that_the_client_returns(setup):
    """The ids travel once, as integers: the client asks for `token_ids` and the embedded server answers them
    (not again as `token_id:N` strings); text and versions are the server's too."""
    tok, env, _, _, address = setup
    prompt = env.encode_prompt(env.train_problems()[0])
    answers = []

    async def sample():
        client = PolicyClient([address])
        post = client._post

        async def recording(server, body):
            answers.append(await post(server, body))
            return answers[-1]

        client._post = recording
        try:
            return await client.sample(prompt, n=3, max_tokens=5, stop_token_ids=[tok.eos_token_id])
        finally:
            await client.aclose()

    samples = asyncio.run(sample())
    [answer] = answers
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    assert len(choices) == len(samples) == 3
    for choice, s in zip(choices, samples, strict=True):
        assert s.token_ids and all(type(t) is int for t in choice["token_ids"])
        assert choice["token_ids"] == s.token_ids
        assert choice["logprobs"]["tokens"] is None  # no second copy of the ids as strings
        assert choice["logprobs"]["token_logprobs"] == s.sampler_logprobs
        assert s.text == choice["text"] == tok.decode(s.token_ids, skip_special_tokens=True)
        assert s.token_versions == versions_from_spans(choice["policy_version_spans"], len(s.token_ids))
    # other clients keep their dialects: vLLM's `token_id:N` strings, OpenAI's token strings (no `token_ids`)
    for extra, expected in (({"return_tokens_as_token_ids": True}, "token_id:{}"), ({}, None)):
        body = {"prompt": prompt, "max_tokens": 3, "logprobs": 0, **extra}
        [choice] = httpx.post(f"http://{address}/v1/completions", json=body, timeout=120).json()["choices"]
        assert "token_ids" not in choice
        tokens = choice["logprobs"]["tokens"]
        assert len(tokens) == len(choice["logprobs"]["token_logprobs"]) and all(isinstance(t, str) for t in tokens)
        if expected is not None:
            assert all(t.startswith("token_id:") for t in tokens)


def test_client_prefers_integer_token_ids_and_falls_back_to_token_id_strings():
    """A hand-written answer: choices with integer `token_ids` (the embedded servers, newer vLLM, which may also
    send the strings), with only `token_id:N` strings (older vLLM), and with neither."""
    logprobs = {"token_logprobs": [-0.5, -1.0, -0.25], "text_offset": None, "top_logprobs": None}
    strings = ["token_id:7", "token_id:8", "token_id:9"]
    common = {"text": "abc", "finish_reason": "length", "policy_version_start": 4, "policy_version_end": 5}
    common["policy_version_spans"] = [{"version": 4, "start": 0, "end": 2}, {"version": 5, "start": 2, "end": 3}]
    answer = {
        "choices": [
            {**common, "index": 1, "token_ids": [7, 8, 9], "logprobs": {**logprobs, "tokens": None}},
            {**common, "index": 0, "logprobs": {**logprobs, "tokens": strings}},
            # both: the integers win (here they disagree with the strings, to tell which was read)
            {**common, "index": 2, "token_ids": [7, 8, 9], "logprobs": {**logprobs, "tokens": ["token_id:1"] * 3}},
        ]
    }
    [samples] = PolicyClient._parse(answer, 1, 3, "s", 0.5)
    for s in samples:
        assert s.token_ids == [7, 8, 9] and s.sampler_logprobs == [-0.5, -1.0, -0.25] and s.text == "abc"
        assert (s.version_start, s.version_end, s.token_versions) == (4, 5, [4, 4, 5])
    one = {**common, "index": 0}
    with pytest.raises(RuntimeError, match="no token ids"):
        PolicyClient._parse({"choices": [{**one, "logprobs": {**logprobs, "tokens": None}}]}, 1, 1, "s", 0.5)
    with pytest.raises(ValueError, match="token_id:N"):  # token strings of a server that ignored both options
        PolicyClient._parse({"choices": [{**one, "logprobs": {**logprobs, "tokens": ["a", "b", "c"]}}]}, 1, 1, "s", 0)
    with pytest.raises(RuntimeError, match="2 token ids and 3 logprobs"):
        PolicyClient._parse({"choices": [{**one, "token_ids": [7, 8], "logprobs": logprobs}]}, 1, 1, "s", 0.5)


def test_a_server_that_never_received_weights_samples_as_version_minus_one(setup):
    """Version -1 ("never served weights") is a version like any other on the way back to the client."""
    tok, env, _, server, address = setup
    served = server.context.version
    server.context.version = -1  # what a server is before its first `apply_weights`
    try:
        client_groups = _sample_groups(env, address, env.train_problems()[:2], 2, SamplingParams(max_tokens=5))
    finally:
        server.context.version = served
    for group in client_groups:
        for rollout in group.rollouts:
            meta = rollout.turns[-1].inference_metadata
            assert meta.version_start == meta.version_end == -1
            assert meta.token_versions == [-1] * len(rollout.turns[-1].token_ids)


def test_choices_report_versions_and_token_ids_as_the_dialect_says():
    from marin_rl.inference.openai_api import Completion, CompletionRequest, completion_choice, completion_response

    tok = build_char_tokenizer()
    request = CompletionRequest(prompt=[5, 6], n=2, logprobs=0, return_tokens_as_token_ids=True)
    straddling = Completion([7, 8, 9], [-0.1, -0.2, -0.3], "abc", "length", [3, 3, 4])
    empty = Completion([], [], "", "stop", [])
    choices = [completion_choice(i, c, request, tok, served_version=-1) for i, c in enumerate([straddling, empty])]
    assert choices[0]["logprobs"]["tokens"] == ["token_id:7", "token_id:8", "token_id:9"]
    assert (choices[0]["policy_version_start"], choices[0]["policy_version_end"]) == (3, 4)
    assert choices[0]["policy_version_spans"] == [
        {"version": 3, "start": 0, "end": 2},
        {"version": 4, "start": 2, "end": 3},
    ]
    assert versions_from_spans(choices[0]["policy_version_spans"], 3) == [3, 3, 4]
    assert "token_ids" not in choices[0]
    # `return_token_ids`: the ids as integers, and not again as strings; plain OpenAI: the tokens' strings
    ids_once = completion_choice(0, straddling, request.model_copy(update={"return_token_ids": True}), tok, -1)
    assert ids_once["token_ids"] == [7, 8, 9] and ids_once["logprobs"]["tokens"] is None
    plain = completion_choice(0, straddling, CompletionRequest(prompt=[5, 6], logprobs=0), tok, -1)
    assert plain["logprobs"]["tokens"] == tok.convert_ids_to_tokens([7, 8, 9]) and "token_ids" not in plain
    # nothing sampled: the version served when the request arrived, also -1 (never received weights)
    assert (choices[1]["policy_version_start"], choices[1]["policy_version_end"]) == (-1, -1)
    body = completion_response(request, 0.0, [[5, 6]], choices, completion_tokens=3)
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def test_control_routes_need_the_run_secret_and_change_what_is_served(setup, tmp_path):
    from marin_rl.broadcast.base import BroadcastConfig, WeightSubscriber, make_transport

    tok, env, learner, server, address = setup
    prompt = env.encode_prompt(env.train_problems()[0])
    url = f"http://{address}/v1/control"
    transport = make_transport(BroadcastConfig(transport="fsspec", path=str(tmp_path / "weights")))
    served = server.version
    off = httpx.post(f"{url}/pause", headers={"Authorization": "Bearer x"}, timeout=30)
    assert off.status_code == 403 and "disabled" in off.text  # no secret set: the routes are off
    server.control_secret = "run-secret"
    server.weights_source = WeightSubscriber(transport, server.apply_weights).poll
    try:
        assert httpx.post(f"{url}/pause", timeout=30).status_code == 401
        assert httpx.post(f"{url}/pause", headers={"Authorization": "Bearer guess"}, timeout=30).status_code == 403
        auth = {"Authorization": "Bearer run-secret"}
        assert httpx.post(f"{url}/reload", headers=auth, timeout=30).status_code == 404

        # paused: a request waits; resumed: it completes
        assert httpx.post(f"{url}/pause", headers=auth, timeout=30).json()["status"] == "pause"
        result = []
        worker = threading.Thread(target=lambda: result.append(_complete(address, prompt, max_tokens=3)))
        worker.start()
        worker.join(timeout=2.0)
        assert worker.is_alive() and not result, "a request completed while the server was paused"
        assert httpx.post(f"{url}/resume", headers=auth, timeout=30).status_code == 200
        worker.join(timeout=60)
        assert len(result[0][0][0]) == 3

        # weights route: the server fetches the latest published version from the run's transport
        transport.publish(served + 5, learner.model)
        body = httpx.post(f"{url}/weights", headers=auth, timeout=120).json()
        assert body["version"] == served + 5 and body["applied"]["version"] == served + 5
        assert _complete(address, prompt, max_tokens=2)[0][2] == served + 5
        assert httpx.post(f"{url}/weights", headers=auth, timeout=120).json()["applied"] is None  # nothing new
    finally:
        server.control_secret = None
        server.weights_source = None
        server.resume()
        server.apply_weights(served, learner.weights())
        transport.close()


def _closed_address() -> str:
    """An address on which nothing listens (a port just bound and released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_request_to_an_unreachable_server_is_sent_to_another_and_counted(setup):
    from marin_rl.inference.client import PolicyClient, ServerUnreachable

    tok, env, _, _, address = setup
    prompt = env.encode_prompt(env.train_problems()[0])
    dead = _closed_address()

    async def sample(servers, seeds):
        client = PolicyClient(servers, timeout_s=30)
        out = [(await client.sample(prompt, n=1, max_tokens=5, seed=s))[0] for s in seeds]
        return out, client.retried_requests

    seeds = [11, 12, 13]
    expected, _ = asyncio.run(sample([address], seeds))
    got, retried = asyncio.run(sample([dead, address], seeds))  # the dead one is tried first (listed first, idle)
    assert retried == 1, "one request found the dead server; later ones avoid it"
    assert [s.token_ids for s in got] == [s.token_ids for s in expected], "a seeded request samples the same"
    assert {s.server for s in got} == {address}
    with pytest.raises(ServerUnreachable, match=dead):
        asyncio.run(sample([dead], [1]))


def test_client_and_server_time_the_same_requests(setup):
    """What the loop profile reads: the client's latency, the backend time each answer reports, the server's busy
    time; the backend time fits inside the latency and inside the server's busy time."""
    from marin_rl.inference.client import PolicyClient

    tok, env, _, server, address = setup
    prompts = [env.encode_prompt(p) for p in env.train_problems()[:12]]
    before = server.stats()

    async def sample():
        client = PolicyClient([address], timeout_s=30, max_concurrent_requests=4, max_prompts_per_request=1)  # 8 wait
        await asyncio.gather(*(client.sample(p, n=2, max_tokens=5) for p in prompts))
        return client

    start = time.perf_counter()
    client = asyncio.run(sample())
    wall = time.perf_counter() - start
    after = server.stats()
    assert client.requests == len(prompts) == after["requests"] - before["requests"]
    assert 0 < client.backend_s < client.request_s  # each answer's backend time, within its latency
    assert 0 < client.queue_s and client.queue_s + client.backend_s < client.request_s  # slot wait: before sending
    busy = after["busy_s"] - before["busy_s"]
    assert 0 < busy <= wall + 1e-3
    assert client.backend_s / len(prompts) <= busy + 1e-3  # one request's backend time fits in the busy time
    assert abs((after["backend_s"] - before["backend_s"]) - client.backend_s) < 1e-6 * len(prompts) + 1e-9
    assert 0 < after["engine_s"] - before["engine_s"] <= busy + 1e-3


def test_concurrent_calls_travel_together_and_a_bad_one_fails_alone(setup):
    """Unseeded calls of one event-loop turn with the same parameters share a request (the completions API's batch
    form); each gets its own n samples, with the versions and logprobs of its own prompt. A prompt the server refuses
    fails only its own call."""
    from marin_rl.inference.client import PolicyClient, ServerError

    tok, env, learner, server, address = setup
    problems = env.train_problems()[:20]
    prompts = [env.encode_prompt(p) for p in problems]
    too_long = prompts[0] * 40  # longer than the server's context
    before = server.stats()["requests"]

    async def sample():
        client = PolicyClient([address], timeout_s=60, max_prompts_per_request=8)
        calls = [client.sample(p, n=3, max_tokens=5, stop_token_ids=[tok.eos_token_id]) for p in prompts]
        bad = client.sample(too_long, n=3, max_tokens=5, stop_token_ids=[tok.eos_token_id])
        results = await asyncio.gather(*calls, bad, return_exceptions=True)
        await client.aclose()
        return results, client.requests

    results, requests = asyncio.run(sample())
    *good, bad = results
    assert isinstance(bad, ServerError) and bad.status == 400 and "max_seq_len" in bad.detail
    assert all(isinstance(r, list) and len(r) == 3 for r in good), [type(r) for r in good if not isinstance(r, list)]
    # 21 calls: requests of 8, 8 and 5 prompts; the last, with the bad prompt, is refused (400) and its calls are
    # resent one by one: 4 answered, the bad one refused again
    assert requests == 2 + 4 and server.stats()["requests"] - before == requests + 2
    rollouts = []
    for prompt, samples in zip(prompts, good, strict=True):
        for s in samples:
            assert s.version_start == 0 == s.version_end and s.token_versions == [0] * len(s.token_ids)
            rollouts.append(Sequence.supervised(prompt, s.token_ids))
            rollouts[-1].sampler_logprobs[len(prompt) :] = s.sampler_logprobs
    batch, placed = pack(rollouts, 16, 64)
    assert len(placed) == len(rollouts)
    diff = np.abs(learner.logprobs(batch) - batch.sampler_logprobs)[batch.loss_mask]
    assert diff.size >= 60 and diff.max() <= 1e-4, "each call got samples of its own prompt"
