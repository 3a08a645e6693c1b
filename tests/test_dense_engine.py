"""The dense-cache engine (`inference.levanter.engine: dense`): what it samples is scored exactly as the learner
scores it, seeded samples depend on the seed alone (not on the batch), segments continue where they stopped, stop
sequences and token limits end generations, new weights are served without recompiling, and other models are refused
with a clear error."""

import asyncio

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
    engine = DenseEngine(
        learner.model,
        _FullDistributionSampler(learner.model.Vocab),
        max_seqs=64,
        max_seq_len=64,
        max_stop_seqs=4,
        max_stop_tokens=16,
    )
    return tok, env, learner, engine


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
        assert server.stats()["batches"] >= 2
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
    engine = DenseEngine(
        learner.model,
        _FullDistributionSampler(learner.model.Vocab),
        max_seqs=64,
        max_seq_len=64,
        max_stop_seqs=4,
        max_stop_tokens=16,
        batch_invariant=True,
    )
    prompts = [env.encode_prompt(p) for p in env.train_problems()[:40]]
    eos = [[tok.eos_token_id]]
    together = engine.generate([_request(p, 100 + i, 5, eos, rid=i) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts[:4]):
        alone = engine.generate([_request(p, 100 + i, 5, eos)])
        assert alone.tokens[0] == together.tokens[i] and alone.logprobs[0] == together.logprobs[i]
