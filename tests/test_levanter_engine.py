"""Levanter's inference engine as the embedded server finds it, and each workaround the server keeps for it.

Every engine-level test pins a behaviour of the pinned Levanter line that a workaround in
`marin_rl/inference/levanter_server.py` exists for; when one fails after a Levanter upgrade, the engine has changed:
re-check that workaround (and delete it if the engine now does the right thing). The server-level half of each test
checks that the server gets it right regardless.
"""

import asyncio

import equinox as eqx
import haliax as hax
import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.inference.engine import InferenceEngine, InferenceEngineConfig, Request
from levanter.inference.jit_scheduler import SeqDecodingParams
from levanter.inference.openai import _encode_stop_tokens
from levanter.layers.sampler import Sampler
from levanter.trainer import TrainerConfig

from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer, _FullDistributionSampler, _replace_leaves
from marin_rl.inference.openai_api import CompletionRequest
from marin_rl.model.build import build_model
from marin_rl.model.config import ModelConfig
from marin_rl.model.logprobs import token_logprobs
from marin_rl.tokenizer import build_char_tokenizer

MAX_SEQ_LEN = 128
PAGE = 16
_TRAINER = TrainerConfig()


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    """The default tiny Llama with noisy weights, so that its next-token distributions are far from uniform."""
    model = build_model(ModelConfig(layout_aware_gradients=False), len(tok))
    rng = np.random.default_rng(0)
    params, static = eqx.partition(model, eqx.is_array)
    params = jax.tree_util.tree_map(lambda x: x + rng.normal(0, 0.3, x.shape).astype(np.float32), params)
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(params)]
    return _replace_leaves(eqx.combine(params, static), leaves, "test")  # placed as the server places weights


@pytest.fixture(scope="module")
def server(model, tok):
    srv = LevanterInferenceServer(
        model,
        tok,
        InferenceConfig(
            max_seqs=8,
            max_seq_len=MAX_SEQ_LEN,
            levanter=LevanterServerConfig(page_size=PAGE, prefill_tokens=256, max_rounds=48, segment_tokens=None),
        ),
    )
    yield srv
    srv.stop()


def _engine(model, tok, **overrides) -> InferenceEngine:
    cfg = dict(
        max_seq_len=MAX_SEQ_LEN,
        page_size=PAGE,
        max_pages=64,
        max_seqs=8,
        max_rounds=8,
        max_queued_tokens=512,
        max_seqs_in_prefill=8,
        max_prefill_size=512,
        compute_dtype=jnp.float32,
        max_stop_seqs=4,
        max_stop_tokens=16,
    )
    cfg.update(overrides)
    with hax.partitioning.set_mesh(_TRAINER.device_mesh), hax.axis_mapping(_TRAINER.compute_axis_mapping):
        return InferenceEngine.from_model_with_config(model=model, tokenizer=tok, config=InferenceEngineConfig(**cfg))


def _request(rid, prompt, max_new, seed, n=1, stop=None) -> Request:
    params = SeqDecodingParams(
        max_num_tokens=np.int32(len(prompt) + max_new),
        stop_tokens=stop,
        temperature=np.float32(1.0),
        top_p=np.float32(1.0),
        key=np.array([0, seed], dtype=np.uint32),
    )
    return Request(prompt_tokens=list(prompt), request_id=rid, decode_params=params, n_generations=n)


def _generate(engine, requests):
    with hax.partitioning.set_mesh(_TRAINER.device_mesh), hax.axis_mapping(_TRAINER.compute_axis_mapping):
        return engine.generate(requests)


@eqx.filter_jit
def _full_logprobs(model, ids):
    Pos = hax.Axis("position", ids.shape[0])
    named = hax.named(ids, Pos)
    return token_logprobs(model, named, hax.arange(Pos), hax.zeros(Pos, dtype=jnp.int32))[0]


def _reference(model, prompt, generated) -> np.ndarray:
    """Teacher-forced logprob of each generated token under `model` (the learner's computation)."""
    ids = np.asarray(list(prompt) + list(generated), dtype=np.int32)
    lp = np.asarray(_full_logprobs(model, jnp.asarray(ids)).array)
    return lp[len(prompt) : len(prompt) + len(generated)]


def _prompt(seed, length, tok):
    return [int(x) for x in np.random.default_rng(seed).integers(8, len(tok), length)]


def _serve(server, prompt, **kwargs):
    request = CompletionRequest(prompt=prompt, logprobs=0, return_tokens_as_token_ids=True, **kwargs)
    return asyncio.run(server.complete(request, [prompt]))


# ---- n > 1: still needed ---------------------------------------------------------------------------------------
def test_engine_n_gt_1_misreports_logprobs_past_one_page_so_the_server_samples_singly(model, tok, server):
    prompt = _prompt(1, 70, tok)  # longer than four KV pages
    result = _generate(_engine(model, tok), [_request(0, prompt, 12, seed=70, n=4)])
    worst = max(
        float(np.abs(_reference(model, prompt, t) - np.asarray(lp)).max())
        for t, lp in zip(result.tokens, result.logprobs, strict=True)
        if t
    )
    assert worst > 1e-3, (
        f"the engine's n>1 logprobs now match the model (max diff {worst:.1e}): LevanterInferenceServer.complete "
        "could pass n to the engine instead of sampling n single requests"
    )
    choices = _serve(server, prompt, n=4, max_tokens=12, seed=70)
    assert len(choices) == 4 and len({tuple(c.token_ids) for c in choices}) > 1
    for c in choices:
        diff = np.abs(_reference(model, prompt, c.token_ids) - np.asarray(c.sampler_logprobs)).max()
        assert diff <= 1e-4, f"served logprobs off by {diff:.1e}"


# ---- stop sequences: still needed ------------------------------------------------------------------------------
def test_levanter_route_merges_stop_strings_so_the_server_keeps_them_apart(model, tok, server):
    merged = _encode_stop_tokens(["7", "+3"], tok)
    assert merged == tok("7+3", add_special_tokens=False)["input_ids"], (
        f"Levanter's OpenAI route now keeps stop strings apart ({merged}): re-check the server's own stop handling"
    )
    prompt = _prompt(2, 6, tok)
    free = _serve(server, prompt, max_tokens=40, seed=5)[0].token_ids
    # tokens that are characters of their own (the char tokenizer's unused ids decode to names like '<unused15>')
    printable = [i for i, t in enumerate(free) if tok(tok.decode([t]), add_special_tokens=False)["input_ids"] == [t]]
    first, later = printable[2], printable[-2:]
    stops = [tok.decode([free[first]]), tok.decode([free[t] for t in later])]
    assert stops[0] not in stops[1] and free.index(free[first]) == first  # the first stop first occurs at `first`
    stopped = _serve(server, prompt, max_tokens=40, seed=5, stop=stops)[0]
    assert stopped.token_ids == free[: first + 1] and stopped.finish_reason == "stop"


# ---- EOS: still needed -----------------------------------------------------------------------------------------
def test_engine_does_not_stop_at_eos_so_it_is_an_explicit_stop(model, tok, server):
    eos = tok.eos_token_id
    prompts = [_prompt(10 + s, 6, tok) for s in range(8)]
    result = _generate(_engine(model, tok), [_request(i, p, 60, seed=i) for i, p in enumerate(prompts)])
    past_eos = [(i, t) for i, t in enumerate(result.tokens) if eos in t[:-1]]
    assert past_eos, "no sample contains EOS: pick other seeds"
    i, tokens = past_eos[0]
    assert len(tokens) == 60, "the engine now stops at EOS by itself: the explicit EOS stop may go"
    served = _serve(server, prompts[i], max_tokens=60, seed=i, stop_token_ids=[eos])[0]
    assert served.token_ids == tokens[: tokens.index(eos) + 1] and served.finish_reason == "stop"


# ---- one prefill per engine call: chunking still needed, the leak is gone --------------------------------------
def test_engine_prefills_once_per_call_so_the_server_chunks_but_nothing_leaks(model, tok, server):
    engine = _engine(model, tok, max_seqs_in_prefill=2)
    prompts = [_prompt(20 + s, 6, tok) for s in range(4)]
    first = _generate(engine, [_request(i, p, 30, seed=i) for i, p in enumerate(prompts)])
    assert [len(t) for t in first.tokens] == [30, 30, 0, 0], "requests beyond one prefill now decode too"
    # The earlier line left those late requests inside the engine, and their tokens leaked into the next call (the
    # server reset the engine defensively); now every generate() starts from a reset engine.
    again = _generate(engine, [_request(0, prompts[0], 30, seed=0)])
    assert again.tokens[0] == first.tokens[0] and int(again.total_generated) == 30
    # The server splits what one prefill cannot admit over several engine calls.
    engine_config = server.context.engine.config
    calls = server.context.num_batches
    many = [_prompt(30 + s, 40, tok) for s in range(8)]  # 320 prompt tokens > prefill_tokens (256)

    async def all_at_once():
        reqs = [CompletionRequest(prompt=p, max_tokens=10, seed=s) for s, p in enumerate(many)]
        return await asyncio.gather(*(server.complete(r, [p]) for r, p in zip(reqs, many, strict=True)))

    served = asyncio.run(all_at_once())
    assert engine_config.max_prefill_size == 256 and server.context.num_batches - calls >= 2
    for p, [c] in zip(many, served, strict=True):
        assert len(c.token_ids) == 10
        assert np.abs(_reference(model, p, c.token_ids) - np.asarray(c.sampler_logprobs)).max() <= 1e-4


# ---- decode rounds per call: the server continues short generations -------------------------------------------
def test_engine_returns_long_generations_short_and_the_server_continues_them(model, tok, server):
    prompt = _prompt(3, 6, tok)
    # max_seq_len // max_rounds outer iterations of max_rounds decode rounds: 2 * 48 = 96 rounds in one call.
    short = _generate(_engine(model, tok, max_rounds=48), [_request(0, prompt, 120, seed=9)]).tokens[0]
    assert len(short) < 120, "the engine now finishes long generations in one call"
    served = _serve(server, prompt, max_tokens=120, seed=9)[0]  # the server's engine has max_rounds 48 too
    assert len(served.token_ids) == 120 and served.finish_reason == "length"
    assert served.token_ids[: len(short)] == list(short)  # continuing the sequence changes nothing already sampled
    assert np.abs(_reference(model, prompt, served.token_ids) - np.asarray(served.sampler_logprobs)).max() <= 1e-4


# ---- top_p = 1: the nucleus filter still drops the tail --------------------------------------------------------
def test_nucleus_filter_drops_the_tail_at_top_p_1_and_the_server_sampler_keeps_it():
    Vocab, Pos = hax.Axis("vocab", 128), hax.Axis("position", 2)
    logits = hax.named(jnp.stack([jax.random.normal(jax.random.PRNGKey(0), (128,)) * 4.0] * 2), (Pos, Vocab))
    full = jax.nn.log_softmax(logits.array[0])
    top_ps = hax.named(jnp.array([1.0, 0.5]), Pos)
    keys = jax.random.split(jax.random.PRNGKey(1), 2)

    filtered = Sampler(Vocab)._apply_top_p(logits, top_ps).array[0]
    dropped = jnp.isinf(filtered)
    assert int(dropped.sum()) > 0, "Levanter's top_p=1 now keeps the whole distribution: the sampler subclass may go"
    tokens, logprobs = hax.vmap(Sampler(Vocab), Pos)(logits, hax.named(jnp.ones(2), Pos), top_ps=top_ps, key=keys)
    assert float(logprobs.array[0] - full[tokens.array[0]]) > 1e-6  # renormalised over the kept mass

    ours = _FullDistributionSampler(Vocab)
    assert not bool(jnp.isinf(ours._apply_top_p(logits, top_ps).array[0]).any())
    tokens, logprobs = hax.vmap(ours, Pos)(logits, hax.named(jnp.ones(2), Pos), top_ps=top_ps, key=keys)
    assert abs(float(logprobs.array[0] - full[tokens.array[0]])) <= 1e-6
    # top_p < 1 is still filtered as Levanter filters it
    assert bool(jnp.isinf(ours._apply_top_p(logits, top_ps).array[1]).any())
    assert float(logprobs.array[1]) > float(full[tokens.array[1]])


# ---- weight swaps: placing new weights like the served ones is still needed ------------------------------------
def test_weights_placed_unlike_the_served_ones_recompile_the_decode_loop(model, tok):
    compiles = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        engine = _engine(model, tok)
        prompt = _prompt(4, 6, tok)
        for _ in range(2):  # warm: everything a call needs is compiled
            _generate(engine, [_request(0, prompt, 10, seed=1)])
        leaves = [np.asarray(x) * 1.01 for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))]
        before = len(compiles)
        engine.model = _replace_leaves(model, leaves, "test")  # what apply_weights does
        _generate(engine, [_request(0, prompt, 10, seed=1)])
        assert len(compiles) == before, "weights placed like the served ones must not recompile"
        params, static = eqx.partition(model, eqx.is_array)
        engine.model = eqx.combine(jax.tree_util.tree_map(lambda x: jnp.asarray(np.asarray(x) * 1.02), params), static)
        _generate(engine, [_request(0, prompt, 10, seed=1)])
        assert len(compiles) > before, "plain device arrays no longer recompile: placing by sharding may be moot"
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
