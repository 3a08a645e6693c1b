"""The dense-cache engine (`inference.levanter.engine: dense`): what it samples is scored exactly as the learner
scores it, seeded samples depend on the seed alone (not on the batch), segments continue where they stopped, stop
sequences and token limits end generations, new weights are served without recompiling, and other models are refused
with a clear error."""

import asyncio
import dataclasses

import haliax as hax
import jax
import numpy as np
import pytest
from levanter.inference.engine import Request
from levanter.inference.jit_scheduler import SeqDecodingParams
from levanter.inference.utils import INVALID

from marin_rl.envs.arithmetic import AdditionEnvironment
from marin_rl.inference.client import PolicyClient
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.dense_engine import DenseEngine, check_supported
from marin_rl.inference.levanter_server import LevanterInferenceServer, _FullDistributionSampler
from marin_rl.learner.config import LearnerConfig, WarmStartConfig
from marin_rl.learner.learner import Learner
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.replay.packing import Sequence, pack
from marin_rl.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def setup():
    tok = build_char_tokenizer()
    env = AdditionEnvironment(tok, max_operand=49, num_eval=50)
    learner = Learner(
        ModelConfig(architecture=tiny_llama()), LearnerConfig(warm_start=WarmStartConfig(steps=30)), len(tok)
    )
    examples = [(env.encode_prompt(p), tok(p.answer)["input_ids"] + [tok.eos_token_id]) for p in env.train_problems()]
    learner.warm_start(examples, 64)  # not uniform: logprobs vary
    return tok, env, learner, _engine(learner, max_seqs=64)


def _engine(learner, max_seqs: int, **options) -> DenseEngine:
    """A dense engine on the learner's model: 64 positions, up to 4 stop sequences of 16 tokens."""
    sampler = _FullDistributionSampler(learner.model.Vocab)
    return DenseEngine(
        learner.model, sampler, max_seqs=max_seqs, max_seq_len=64, max_stop_seqs=4, max_stop_tokens=16, **options
    )


def _request(prompt, seed, max_new, stops=None, temperature=1.0, rid=0):
    stop = None
    if stops:
        width = max(len(s) for s in stops)
        arr = np.full((len(stops), width), INVALID, np.int32)
        for i, s in enumerate(stops):
            arr[i, width - len(s) :] = s
        stop = hax.named(arr, ("stop_seq", "position"))
    params = SeqDecodingParams(
        max_num_tokens=np.int32(len(prompt) + max_new),
        stop_tokens=stop,
        temperature=np.float32(temperature),
        top_p=np.float32(1.0),
        key=np.array([0, seed], np.uint32),
    )
    return Request(list(prompt), rid, params, 1)


def test_samples_score_as_the_learner_scores_them_and_depend_only_on_their_seed(setup):
    tok, env, learner, engine = setup
    prompts = [env.encode_prompt(p) for p in env.train_problems()[:40]]
    eos = [[tok.eos_token_id]]
    alone = [engine.generate([_request(p, 100 + i, 5, eos)]) for i, p in enumerate(prompts[:6])]
    together = engine.generate([_request(p, 100 + i, 5, eos, rid=i) for i, p in enumerate(prompts)])
    for i, one in enumerate(alone):  # the same seed samples the same tokens, whatever shares the batch
        assert one.tokens[0] == together.tokens[i] and np.allclose(one.logprobs[0], together.logprobs[i], atol=1e-6)
    seqs = []
    for p, toks, lps in zip(prompts, together.tokens, together.logprobs, strict=True):
        assert 1 <= len(toks) <= 5 and (toks[-1] == tok.eos_token_id or len(toks) == 5)
        assert tok.eos_token_id not in toks[:-1], "generation ends at the stop token"
        s = Sequence.supervised(p, toks)
        s.sampler_logprobs[len(p) :] = lps
        seqs.append(s)
    batch, placed = pack(seqs, 16, 64)
    assert len(placed) == len(seqs)
    diff = np.abs(learner.logprobs(batch) - batch.sampler_logprobs)[batch.loss_mask]
    assert diff.size >= 80 and diff.max() <= 1e-4, diff.max()
    greedy = engine.generate([_request(prompts[0], s, 5, eos, temperature=0.0) for s in (1, 2)])
    assert greedy.tokens[0] == greedy.tokens[1], "temperature 0 is greedy whatever the seed"


def test_segments_continue_what_one_pass_samples_and_stops_end_generations(setup):
    tok, env, learner, engine = setup
    prompt = env.encode_prompt(env.train_problems()[3])
    [whole] = engine.generate([_request(prompt, 7, 12)]).tokens
    assert len(whole) == 12  # no stop: the token limit ends it
    first = engine.generate([_request(prompt, 7, 5)]).tokens[0]
    rest = engine.generate([_request(prompt + first, 7, 7)]).tokens[0]
    assert first + rest == whole, "per-position keys: a continued generation samples what one pass does"
    stop = whole[3:5]  # a two-token stop sequence that occurs in the sample
    [cut] = engine.generate([_request(prompt, 7, 12, [stop, [tok.eos_token_id]])]).tokens
    k = next(i for i in range(1, len(whole)) if whole[i - 1 : i + 1] == stop or whole[i] == tok.eos_token_id)
    assert cut == whole[: k + 1], "generation ends with (and includes) the first stop sequence"


def test_the_server_on_the_dense_engine_serves_new_weights_without_recompiling(setup):
    tok, env, learner, _ = setup
    config = InferenceConfig(max_seqs=32, max_seq_len=64, levanter=LevanterServerConfig(engine="dense"))
    server = LevanterInferenceServer(learner.model, tok, config)
    address = server.start()
    prompt = env.encode_prompt(env.train_problems()[0])

    async def sample():
        client = PolicyClient([address], timeout_s=120)
        out = await client.sample(prompt, n=4, max_tokens=5, seed=3, stop_token_ids=[tok.eos_token_id])
        await client.aclose()
        return out

    try:
        server.apply_weights(0, learner.weights())
        before = asyncio.run(sample())
        compiled = server.context.engine.compiled_programs()
        learner.warm_start([(prompt, tok("99")["input_ids"] + [tok.eos_token_id])] * 8, 64)  # new weights
        server.apply_weights(1, learner.weights())
        after = asyncio.run(sample())
        assert server.context.engine.compiled_programs() == compiled, "new weights recompiled"
        assert all(s.version_start == s.version_end == 1 for s in after)
        assert [s.token_ids for s in before] != [s.token_ids for s in after]
        assert server.stats()["batches"] >= 2, server.stats()
    finally:
        server.stop()


def test_models_it_cannot_decode_are_refused_by_name():
    from levanter.models.gpt2 import Gpt2Config

    config = Gpt2Config(max_seq_len=32, hidden_dim=32, num_layers=1, num_heads=2)
    gpt2 = config.build(hax.Axis("vocab", 40), key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="inference.backend: vllm"):
        check_supported(gpt2)


def test_batch_invariant_engine_gives_bit_identical_logprobs_whatever_shares_the_batch(setup):
    """Deterministic runs: a seeded request scores the same to the last bit alone or among 39 others (each row count
    is its own compiled program, whose results differ in the last bits; batch_invariant uses one)."""
    tok, env, learner, _ = setup
    engine = _engine(learner, max_seqs=64, batch_invariant=True)
    prompts = [env.encode_prompt(p) for p in env.train_problems()[:40]]
    eos = [[tok.eos_token_id]]
    together = engine.generate([_request(p, 100 + i, 5, eos, rid=i) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts[:4]):
        alone = engine.generate([_request(p, 100 + i, 5, eos)])
        assert alone.tokens[0] == together.tokens[i] and alone.logprobs[0] == together.logprobs[i]


def test_continuous_batching_refills_freed_slots_and_shares_a_groups_prefill(setup):
    """More sequences than slots, of different lengths: each samples what it samples alone (its seed decides), a slot
    that frees takes a waiting sequence within the call (so the call's decode steps stay near the total work over the
    slots, not waves of the longest), and a group's samples prefill their prompt once."""
    tok, env, learner, _ = setup
    engine = _engine(learner, max_seqs=8, decode_steps=2)
    prompts = [env.encode_prompt(p) for p in env.train_problems()[:6]]
    lengths = [1, 12, 3, 7, 2, 12]
    requests = [
        _request(prompts[i % 6], 500 + i, lengths[i % 6] + (i // 6), rid=i) for i in range(24)
    ]  # no stop: each runs to its limit
    wanted = [len(r.prompt_tokens) for r in requests]
    before = dataclasses.replace(engine.stats)
    together = engine.generate(requests)
    stats = dataclasses.replace(engine.stats)  # after the call, before the calls below
    for i, r in enumerate(requests):
        assert len(together.tokens[i]) == r.decode_params.max_num_tokens - wanted[i]
    for i in (0, 1, 9, 17, 23):
        alone = engine.generate([requests[i]])
        assert alone.tokens[0] == together.tokens[i]
        assert np.allclose(alone.logprobs[0], together.logprobs[i], atol=1e-5)
    admitted = stats.admitted - before.admitted
    assert admitted == 24 > engine.max_seqs
    # static batching: waves of 8, each as long as its longest (the first token of each comes from the prefill)
    static = sum(max(len(t) for t in together.tokens[w : w + 8]) - 1 for w in range(0, 24, 8))
    steps = stats.decode_steps - before.decode_steps
    assert steps < static, (steps, static)
    occupancy = (stats.live_slot_steps - before.live_slot_steps) / (stats.slot_steps - before.slot_steps)
    assert occupancy > 0.7, occupancy
    # a group: four samples of one prompt prefill it once
    engine.stats = type(engine.stats)()
    group = engine.generate([_request(prompts[0], 900 + k, 4, rid=k) for k in range(4)])
    assert engine.stats.prefilled_prompts == 1 and engine.stats.admitted == 4
    for k in range(4):  # each sample is its own seed's, as alone
        assert engine.generate([_request(prompts[0], 900 + k, 4)]).tokens[0] == group.tokens[k]


def test_requests_that_arrive_during_a_call_join_it_and_each_is_told_as_it_ends(setup):
    """`more` is asked between chunks while a slot is free: arrivals join the running call (no second call), sample
    what they sample alone, and `finished` hears of each one as it ends, short ones before the long one."""
    tok, env, learner, _ = setup
    engine = _engine(learner, max_seqs=16, decode_steps=2)
    prompts = [env.encode_prompt(p) for p in env.train_problems()[:4]]
    long = _request(prompts[0], 1, 30, rid=0)
    arrivals = [[_request(prompts[1], 2, 3, rid=1)], [], [_request(prompts[2], 3, 4), _request(prompts[3], 4, 40)]]
    asked, order = [], []

    def more(positions):
        asked.append(positions)
        return arrivals.pop(0) if arrivals else []

    result = engine.generate([long], more=more, finished=lambda i, t, lp, _: order.append((i, len(t))))
    assert len(result.tokens) == 4 and len(asked) >= 3
    assert asked[0] >= len(prompts[3]) + 40, "the call's cache holds the longest arrival (more() must not give more)"
    assert [len(t) for t in result.tokens] == [30, 3, 4, 40]
    assert order[0][0] in (1, 2) and order.index((0, 30)) > order.index((1, 3)), order
    for i, r in enumerate([long, _request(prompts[1], 2, 3), _request(prompts[2], 3, 4)]):
        assert engine.generate([r]).tokens[0] == result.tokens[i]
