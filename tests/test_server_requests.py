"""The embedded server checks requests as OpenAI does: every bad field alone and mixed into a concurrent burst of good
requests is a 400 naming the field (never a 200, never a 500), and every good request gets exactly the choices it
asked for. The in-process client refuses the same requests; the optional API key guards the OpenAI routes."""

import asyncio
import json
import logging

import httpx
import numpy as np
import pytest

from marin_rl.inference.client import PolicyClient, ServerError
from marin_rl.inference.completion_request import seed_key
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.inference.local_client import InProcessPolicyClient
from marin_rl.model.build import build_model
from marin_rl.model.config import ModelConfig
from marin_rl.tokenizer import build_char_tokenizer

MAX_SEQ_LEN = 64
MAX_N = 16
MAX_PROMPTS = 8
DROP = object()
"""A field value that leaves the field out of the request."""
GOOD = {"prompt": [5, 6, 7, 8], "max_tokens": 3, "n": 2, "logprobs": 0, "return_token_ids": True}

BAD: list[tuple[str, dict, str | None]] = [
    # (case, fields that replace GOOD's (`DROP`: leave the field out), the `param` the refusal names)
    ("token id above the vocabulary", {"prompt": [5, 10**9]}, "prompt"),
    ("negative token id", {"prompt": [5, -3]}, "prompt"),
    ("token id beyond int64", {"prompt": [5, 2**70]}, "prompt"),
    ("no prompt in the list", {"prompt": []}, "prompt"),
    ("empty string prompt", {"prompt": ""}, "prompt"),
    ("empty token-id prompt", {"prompt": [[]]}, "prompt"),
    ("one empty prompt of two", {"prompt": [[5], []]}, "prompt"),
    ("too many prompts", {"prompt": [[5, 6]] * (MAX_PROMPTS + 1)}, "prompt"),
    ("prompt over the context", {"prompt": [5] * MAX_SEQ_LEN}, "prompt"),
    ("fractional token id", {"prompt": [5, 1.5]}, "prompt"),
    ("prompt of another type", {"prompt": {"text": "hi"}}, "prompt"),
    ("prompt missing", {"prompt": DROP}, "prompt"),
    ("negative temperature", {"temperature": -1}, "temperature"),
    ("NaN temperature", {"temperature": float("nan")}, "temperature"),
    ("infinite temperature", {"temperature": float("inf")}, "temperature"),
    ("temperature as a string", {"temperature": "1"}, "temperature"),
    ("n zero", {"n": 0}, "n"),
    ("n negative", {"n": -1}, "n"),
    ("n huge", {"n": 100000}, "n"),
    ("n above max_n", {"n": MAX_N + 1}, "n"),
    ("n as a string", {"n": "2"}, "n"),
    ("n fractional", {"n": 2.5}, "n"),
    ("n boolean", {"n": True}, "n"),
    ("max_tokens zero", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", {"max_tokens": -5}, "max_tokens"),
    ("max_tokens huge", {"max_tokens": 10**9}, "max_tokens"),
    ("max_tokens the whole context", {"max_tokens": MAX_SEQ_LEN}, "max_tokens"),
    ("max_tokens null", {"max_tokens": None}, "max_tokens"),
    ("seed beyond int64", {"seed": 2**64}, "seed"),
    ("seed below int64", {"seed": -(2**63) - 1}, "seed"),
    ("seed fractional", {"seed": 1.5}, "seed"),
    ("seed as a string", {"seed": "7"}, "seed"),
    ("logprobs negative", {"logprobs": -1}, "logprobs"),
    ("logprobs above OpenAI's 5", {"logprobs": 6}, "logprobs"),
    ("top_p zero", {"top_p": 0}, "top_p"),
    ("top_p above one", {"top_p": 1.5}, "top_p"),
    ("top_p below one (whole distribution only)", {"top_p": 0.5}, "top_p"),
    ("five stop strings", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("stop string longer than the engine matches", {"stop": "x" * 17}, "stop"),
    ("stop of another type", {"stop": 123}, "stop"),
    ("stop id above the vocabulary", {"stop_token_ids": [10**9]}, "stop_token_ids"),
    ("negative stop id", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("more stop sequences than the engine matches", {"stop_token_ids": [1, 2, 3, 4, 5]}, "stop_token_ids"),
    ("streaming", {"stream": True}, "stream"),
    ("echo", {"echo": True}, "echo"),
    ("scoring (echo, max_tokens 0) with n above 1", {"echo": True, "max_tokens": 0}, "n"),
    ("scoring without logprobs", {"echo": True, "max_tokens": 0, "n": 1, "logprobs": DROP}, "logprobs"),
    ("scoring a prompt over the context", {"echo": True, "max_tokens": 0, "n": 1, "prompt": [5] * 65}, "prompt"),
    ("suffix", {"suffix": "x"}, "suffix"),
    ("best_of above n", {"best_of": 3}, "best_of"),
    ("presence penalty", {"presence_penalty": 0.5}, "presence_penalty"),
    ("frequency penalty", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("logit bias", {"logit_bias": {"5": 1.0}}, "logit_bias"),
    ("return_token_ids as a string", {"return_token_ids": "yes"}, "return_token_ids"),
]
RAW_BAD: list[tuple[str, bytes, str | None]] = [
    ("not JSON", b"prompt=5", None),
    ("a JSON list", b"[1, 2, 3]", None),
    ("truncated JSON", b'{"prompt": [5, 6', None),
]


def _body(overrides: dict) -> bytes:
    body = {**GOOD, **overrides}
    return json.dumps({k: v for k, v in body.items() if v is not DROP}).encode()  # NaN and Infinity as JS spells them


@pytest.fixture(scope="module")
def served():
    tok = build_char_tokenizer()
    model = build_model(ModelConfig(), len(tok))
    config = InferenceConfig(
        max_seqs=64,
        max_seq_len=MAX_SEQ_LEN,
        max_n=MAX_N,
        max_prompts=MAX_PROMPTS,
        levanter=LevanterServerConfig(page_size=16, prefill_tokens=512, segment_tokens=None),
    )
    server = LevanterInferenceServer(model, tok, config)
    address = server.start()
    yield tok, server, address
    server.stop()


def _post(address: str, content: bytes, headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        f"http://{address}/v1/completions",
        content=content,
        headers={"Content-Type": "application/json", **(headers or {})},
        timeout=120,
    )


def _assert_refused(r: httpx.Response, param: str | None, case: str) -> None:
    assert r.status_code == 400, (case, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], (case, error)
    assert error["type"] == "invalid_request_error" and error["code"] is None, (case, error)
    assert error["param"] == param, (case, error)
    assert "choices" not in r.json()


@pytest.mark.parametrize("case,overrides,param", BAD, ids=[c for c, _, _ in BAD])
def test_each_bad_field_alone_is_a_400_naming_it(served, case, overrides, param):
    _, server, address = served
    failed = server.counters.failed
    _assert_refused(_post(address, _body(overrides)), param, case)
    assert server.counters.failed == failed


@pytest.mark.parametrize("case,content,param", RAW_BAD, ids=[c for c, _, _ in RAW_BAD])
def test_a_body_that_is_not_a_request_is_a_400(served, case, content, param):
    _, _, address = served
    _assert_refused(_post(address, content), param, case)


ACCEPTED: list[tuple[str, dict]] = [
    ("seed -1", {"seed": -1}),
    ("seed 2^40", {"seed": 2**40}),
    ("largest int64 seed", {"seed": 2**63 - 1}),
    ("smallest int64 seed", {"seed": -(2**63)}),
    ("tiny temperature (greedy)", {"temperature": 1e-30}),
    ("greedy", {"temperature": 0}),
    ("integer temperature", {"temperature": 2}),
    ("max_tokens the prompt leaves no room for", {"max_tokens": MAX_SEQ_LEN - 1}),
    ("best_of equal to n", {"best_of": 2}),
    ("stream false", {"stream": False}),
    ("fields OpenAI does not know", {"foo": 1, "user": "someone"}),
    ("prompt as text", {"prompt": "abc"}),
    ("two prompts", {"prompt": [[5, 6], [7, 8, 9]]}),
    ("stop strings and ids", {"stop": ["ab", "c"], "stop_token_ids": [3, 4]}),
]


@pytest.mark.parametrize("case,overrides", ACCEPTED, ids=[c for c, _ in ACCEPTED])
def test_edge_values_that_are_valid_are_served(served, case, overrides):
    _, _, address = served
    r = _post(address, _body(overrides))
    assert r.status_code == 200, (case, r.text[:300])
    body = r.json()
    prompts = overrides.get("prompt", GOOD["prompt"])
    prompts = prompts if isinstance(prompts, list) and isinstance(prompts[0], list) else [prompts]
    assert len(body["choices"]) == GOOD["n"] * len(prompts)
    # a prompt that leaves less room than max_tokens gets what room there is
    room = MAX_SEQ_LEN - max(len(p) for p in prompts)
    for choice in body["choices"]:
        assert np.isfinite(choice["logprobs"]["token_logprobs"]).all()
        assert 1 <= len(choice["token_ids"]) <= min(overrides.get("max_tokens", GOOD["max_tokens"]), room)


def test_int64_seeds_map_to_distinct_keys_and_choice_k_uses_seed_plus_k(served):
    assert seed_key(5).tolist() == [0, 5]  # seeds below 2^32 keep the key they always had
    assert seed_key(-1).tolist() == [2**32 - 1, 2**32 - 1] and seed_key(-1, 1).tolist() == [0, 0]
    assert seed_key(2**32).tolist() == [1, 0] and seed_key(2**63 - 1, 1).tolist() == [2**31, 0]
    _, _, address = served

    def choices(seed, n):
        r = _post(address, _body({"seed": seed, "n": n, "temperature": 1.0, "max_tokens": 6}))
        assert r.status_code == 200, r.text
        return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in r.json()["choices"]]

    assert choices(-1, 2)[1] == choices(0, 1)[0], "choice 1 of seed -1 samples with seed 0"
    assert choices(-1, 2) == choices(-1, 2), "a seeded request samples the same"
    assert choices(2**32, 1) != choices(0, 1), "seeds 2^32 apart are different keys"


def test_bad_requests_in_a_concurrent_burst_fail_alone(served):
    """Good requests (n from 1 to 8, seeded and not) with every bad request of `BAD` mixed in, all in flight at once:
    each bad one is a 400 naming its field, each good one is answered with exactly its n choices."""
    _, server, address = served
    rng = np.random.default_rng(0)
    jobs: list[tuple[str, bytes, int | str | None]] = []  # (case, body, n for a good request or the bad param)
    for i in range(160):
        n = 1 + i % 8
        fields = {"n": n, "prompt": rng.integers(3, 100, int(rng.integers(2, 12))).tolist()}
        if i % 2:
            fields["seed"] = int(rng.integers(-(2**63), 2**63 - 1))
        jobs.append(("good", _body(fields), n))
    jobs += [(case, _body(overrides), param) for case, overrides, param in BAD]
    jobs += [(case, content, param) for case, content, param in RAW_BAD]
    order = rng.permutation(len(jobs))
    jobs = [jobs[i] for i in order]
    before = dict(failed=server.counters.failed, rejected=server.counters.rejected)

    async def burst():
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            url = f"http://{address}/v1/completions"
            headers = {"Content-Type": "application/json"}
            return await asyncio.gather(*(client.post(url, content=body, headers=headers) for _, body, _ in jobs))

    answers = asyncio.run(burst())
    for (case, _, expected), r in zip(jobs, answers, strict=True):
        if case == "good":
            assert r.status_code == 200, r.text[:300]
            assert len(r.json()["choices"]) == expected
            assert sorted(c["index"] for c in r.json()["choices"]) == list(range(expected))
        else:
            _assert_refused(r, expected, case)
    assert server.counters.failed == before["failed"], "no request may be answered 500"
    assert server.counters.rejected - before["rejected"] == len(BAD) + len(RAW_BAD)


def test_the_in_process_client_refuses_what_the_http_front_end_refuses(served):
    _, server, _ = served
    client = InProcessPolicyClient(server)
    cases = [
        ({"prompt_ids": [5, 10**9]}, "prompt"),
        ({"prompt_ids": []}, "prompt"),
        ({"n": 0}, "n"),
        ({"n": MAX_N + 1}, "n"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"seed": 2**64}, "seed"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ]

    async def sample(**kwargs):
        args = {"prompt_ids": [5, 6, 7], "n": 2, "max_tokens": 3, **kwargs}
        return await client.sample(args.pop("prompt_ids"), **args)

    for kwargs, param in cases:
        with pytest.raises(ServerError) as refused:
            asyncio.run(sample(**kwargs))
        assert refused.value.status == 400 and refused.value.param == param, (kwargs, refused.value)
    samples = asyncio.run(sample(seed=-1))
    assert len(samples) == 2 and all(1 <= len(s.token_ids) <= 3 for s in samples)


def test_api_key_guards_the_openai_routes(served):
    import openai

    _, server, address = served
    server.api_key = "the-key"
    try:
        url = f"http://{address}"
        missing = _post(address, _body({}))
        assert missing.status_code == 401 and "choices" not in missing.json()
        assert missing.json()["error"]["type"] == "invalid_request_error"
        wrong = _post(address, _body({}), {"Authorization": "Bearer guess"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
        assert _post(address, _body({}), {"Authorization": "Bearer the-key"}).status_code == 200
        # monitors need no key
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert httpx.get(f"{url}/v1/version", timeout=30).status_code == 200

        async def sample(api_key):
            client = PolicyClient([address], timeout_s=60, api_key=api_key)
            try:
                return await client.sample([5, 6, 7], n=2, max_tokens=3)
            finally:
                await client.aclose()

        assert len(asyncio.run(sample("the-key"))) == 2
        with pytest.raises(ServerError) as refused:
            asyncio.run(sample(None))
        assert refused.value.status == 401

        # OpenAI's own client: the key, its error classes, the field a refusal names
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key="the-key", max_retries=0)
        out = oai.completions.create(model="policy", prompt=[5, 6, 7], max_tokens=3, n=2)
        assert len(out.choices) == 2
        with pytest.raises(openai.BadRequestError) as bad:
            oai.completions.create(model="policy", prompt=[5, 6, 7], max_tokens=3, n=MAX_N + 1)
        assert bad.value.param == "n"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="guess", max_retries=0).completions.create(
                model="policy", prompt=[5, 6, 7], max_tokens=3
            )
    finally:
        server.api_key = None


def test_an_unexpected_failure_is_a_500_in_openai_shape_with_a_logged_traceback(served, caplog):
    """The catch-all: whatever the backend raises that is not the client's fault is a 500 of the same shape (the
    connection stays usable), and the server logs the traceback."""
    _, server, address = served

    async def broken(request, prompts):
        raise KeyError("engine state")

    server.complete = broken
    try:
        with caplog.at_level(logging.ERROR, logger="marin_rl.inference.openai_api"):
            r = _post(address, _body({}))
    finally:
        del server.complete
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert any(rec.exc_info and rec.exc_info[0] is KeyError for rec in caplog.records)
    assert _post(address, _body({})).status_code == 200
