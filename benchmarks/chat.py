"""Chat route benchmark: `/v1/chat/completions` (with token capture) against `/v1/completions` on the same requests.

One embedded server (`LevanterInferenceServer`) serves the project's default tiny Llama (`tiny_llama`, the character
vocabulary, whose chat template lists tools). `--requests` agent-style conversations (a user question, a tool call and
its result, with the calculator tool listed) are sent at once over HTTP to each route: to the chat route as messages
and tools, each in its own session (`X-Session-Id`, so every choice is captured), and to the completions route as the
token ids the same chat template renders (`inference.chat.render_prompt`), with the template's end-of-turn ids as
stop tokens. Both ask for `--n` choices of `--max-tokens` tokens at temperature 1 with the same seed per request, so
the engine samples the same tokens for both (checked: the sampled token counts must be equal). Rounds alternate
between the routes (`--rounds` each, after a warm-up of both); the best round of each is kept.

Printed: each route's requests/s and sampled tokens/s, the sessions captured, and the figure
`chat_over_completions=<chat requests/s over completions requests/s>` (1.0: the chat route costs nothing more; the
difference is rendering the template, parsing tool calls and capturing the tokens).

Run: `python benchmarks/chat.py` (256 requests, n=4, 32 tokens, 3 rounds); `--smoke` runs a tiny load in seconds
(the test suite does, so the benchmark cannot break unnoticed).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import time

import httpx
from levanter.models.llama import LlamaConfig

from marin_rl.inference.chat import ChatMessage, end_of_turn_ids, render_prompt, template_messages
from marin_rl.inference.config import InferenceConfig, LevanterServerConfig
from marin_rl.inference.levanter_server import LevanterInferenceServer
from marin_rl.model.build import build_model, parameter_count
from marin_rl.model.config import ModelConfig, tiny_llama
from marin_rl.tokenizer import build_char_tokenizer

MAX_SEQ_LEN = 512
TOOLS = [
    {
        "type": "function",
        "function": {"name": "calc", "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}},
    }
]


def smoke_model() -> LlamaConfig:
    """A smaller Llama for the smoke run (compiles in seconds)."""
    return LlamaConfig(
        max_seq_len=MAX_SEQ_LEN,
        hidden_dim=32,
        intermediate_dim=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        gradient_checkpointing=False,
        scan_layers=True,
        tie_word_embeddings=False,
    )


def conversation(i: int) -> list[dict]:
    """An agent's conversation after one tool call: question, call, result."""
    a, b = 10 + 37 * i % 90, 100 + 53 * i % 900
    arguments = json.dumps({"e": f"{a}*{b}"})
    call = {"id": f"call_{i}", "type": "function", "function": {"name": "calc", "arguments": arguments}}
    return [
        {"role": "user", "content": f"{a}*{b}="},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{i}", "content": str(a * b)},
    ]


def bodies(tok, num: int, n: int, max_tokens: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(chat bodies, completions bodies) of the same `num` requests."""
    stops = end_of_turn_ids(tok)
    chat, completions = [], []
    for i in range(num):
        messages = conversation(i)
        sampling = {"n": n, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed + i}
        chat.append({"model": "policy", "messages": messages, "tools": TOOLS, **sampling})
        parsed = [ChatMessage.model_validate(m) for m in messages]
        prompt = render_prompt(tok, template_messages(parsed, tok), TOOLS)
        completions.append({"model": "policy", "prompt": prompt, "stop_token_ids": stops, "logprobs": 0, **sampling})
    return chat, completions


async def send(address: str, route: str, requests: list[dict], sessions: bool) -> tuple[float, int]:
    """Send every request at once; (wall seconds, sampled tokens). Every answer must be a 200."""
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=len(requests))
    async with httpx.AsyncClient(base_url=f"http://{address}/v1", timeout=600, limits=limits) as http:

        async def one(i: int, body: dict) -> int:
            headers = {"X-Session-Id": f"bench-{i}"} if sessions else None
            r = await http.post(route, json=body, headers=headers)
            if r.status_code != 200:
                raise RuntimeError(f"{route} answered {r.status_code}: {r.text[:300]}")
            return int(r.json()["usage"]["completion_tokens"])

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(i, b) for i, b in enumerate(requests)))
        return time.perf_counter() - start, sum(tokens)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--n", type=int, default=4, help="choices per request")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per route")
    parser.add_argument("--max-seqs", type=int, default=128, help="inference.max_seqs of the server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a tiny load (seconds): checks it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.n, args.max_tokens, args.rounds, args.max_seqs = 8, 2, 4, 1, 16
    logging.basicConfig(level=logging.WARNING)
    for name in ("levanter", "httpx", "uvicorn"):
        logging.getLogger(name).setLevel(logging.CRITICAL if name == "uvicorn" else logging.ERROR)

    tok = build_char_tokenizer()
    arch = smoke_model() if args.smoke else tiny_llama()
    arch = dataclasses.replace(arch, max_seq_len=MAX_SEQ_LEN)
    model = build_model(ModelConfig(architecture=arch), len(tok))
    config = InferenceConfig(
        max_seqs=args.max_seqs,
        max_seq_len=MAX_SEQ_LEN,
        levanter=LevanterServerConfig(page_size=16, prefill_tokens=8192, segment_tokens=None),
    )
    server = LevanterInferenceServer(model, tok, config)
    address = server.start()
    print(
        f"model: Llama {parameter_count(model) / 1e6:.2f}M parameters; {args.requests} requests of n={args.n} x "
        f"{args.max_tokens} tokens, {args.rounds} rounds per route"
    )
    try:
        chat, completions = bodies(tok, args.requests, args.n, args.max_tokens, args.seed)
        asyncio.run(send(address, "/completions", completions, False))  # compiles
        asyncio.run(send(address, "/chat/completions", chat, True))
        best: dict[str, tuple[float, int]] = {}
        for _ in range(args.rounds):
            for route, requests, sessions in (("/completions", completions, False), ("/chat/completions", chat, True)):
                wall, tokens = asyncio.run(send(address, route, requests, sessions))
                if route not in best or wall < best[route][0]:
                    best[route] = (wall, tokens)
        captured = sum(len(server.app.state.sessions.pop(f"bench-{i}").records) for i in range(args.requests))
    finally:
        server.stop()
    (c_wall, c_tokens), (h_wall, h_tokens) = best["/completions"], best["/chat/completions"]
    if c_tokens != h_tokens:
        raise RuntimeError(f"the routes sampled {c_tokens} and {h_tokens} tokens for the same seeded requests")
    for route, (wall, tokens) in best.items():
        print(f"{route}: {args.requests / wall:.1f} requests/s, {tokens / wall:.0f} sampled tokens/s (best round)")
    expected = (args.rounds + 1) * args.n * args.requests
    if captured != expected:
        raise RuntimeError(f"the chat sessions captured {captured} choices, expected {expected}")
    print(f"chat sessions captured: {captured} choices (every chat round's, warm-up included)")
    print(f"chat_over_completions={(args.requests / h_wall) / (args.requests / c_wall):.3f}")


if __name__ == "__main__":
    main()
