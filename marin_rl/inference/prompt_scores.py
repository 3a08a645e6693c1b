"""A scored prompt (OpenAI's legacy prompt logprobs, `echo: true` with `max_tokens: 0`) and its top-k alternatives.

A scoring request with `logprobs: k` > 0 asks, at every position after the first, for the k most likely tokens of
the distribution that predicts it: OpenAI's `top_logprobs`, one `{token: logprob}` object per position (`null` for
the first). With `return_tokens_as_token_ids` the keys are `token_id:N` strings, so the ids travel exactly; vLLM's
prompt logprobs add the prompt's own token when it is not among the k, so a position may carry k + 1 entries, of
which the k most likely are kept. `top_logprobs_arrays` turns that into `[positions, k]` integer ids and logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_SCORING_LOGPROBS = 20
"""The largest `logprobs` (top-k) of a scoring request: vLLM's default `--max-logprobs`."""

TOKEN_ID_PREFIX = "token_id:"
"""How a token is spelled as a key of `top_logprobs` with `return_tokens_as_token_ids` (vLLM's convention)."""


@dataclass
class PromptScores:
    """One scored prompt: the logprob of each token after the first given the ones before it, and optionally the k
    most likely tokens at each of those positions."""

    logprobs: list[float]
    """Logprob of each token after the first (`len(prompt) - 1` values)."""
    top_ids: np.ndarray | None = None
    """`[len(prompt) - 1, k]` int32 ids of the k most likely tokens at each position, most likely first; None when
    no top-k was asked for."""
    top_logprobs: np.ndarray | None = None
    """`[len(prompt) - 1, k]` float32 logprobs of `top_ids`."""


def top_logprobs_entries(ids: np.ndarray, logprobs: np.ndarray, as_token_ids: bool, tokenizer=None) -> list[dict]:
    """OpenAI's `top_logprobs` objects of positions (`ids`, `logprobs`: `[positions, k]`): keys `token_id:N` with
    `as_token_ids`, else the tokenizer's token strings (ids that spell the same string keep the likelier one)."""
    out = []
    for row_ids, row_lps in zip(ids.tolist(), logprobs.tolist(), strict=True):
        if as_token_ids:
            keys = [f"{TOKEN_ID_PREFIX}{i}" for i in row_ids]
        else:
            keys = tokenizer.convert_ids_to_tokens(row_ids)
        entry: dict[str, float] = {}
        for key, lp in zip(keys, row_lps, strict=True):
            entry.setdefault(str(key), float(lp))
        out.append(entry)
    return out


def top_logprobs_arrays(entries: list, k: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """`[len(entries), k]` int32 ids and float32 logprobs from `top_logprobs` objects keyed `token_id:N`, the k most
    likely of each (ties: the smaller id first). Raises RuntimeError naming `where` for a position with fewer than k
    entries, a key that is not a token id, or a logprob that is not a finite number <= 0."""
    ids = np.zeros((len(entries), k), np.int32)
    lps = np.zeros((len(entries), k), np.float32)
    for p, entry in enumerate(entries):
        if not isinstance(entry, dict) or len(entry) < k:
            got = len(entry) if isinstance(entry, dict) else 0
            raise RuntimeError(f"{where}: position {p + 1} has {got} top logprobs, {k} asked for")
        pairs = []
        for key, lp in entry.items():
            if not (isinstance(key, str) and key.startswith(TOKEN_ID_PREFIX) and key[len(TOKEN_ID_PREFIX) :].isdigit()):
                raise RuntimeError(f"{where}: top logprob key {key!r} is not a token id ('token_id:N')")
            if not (isinstance(lp, (int, float)) and np.isfinite(lp) and lp <= 1e-6):
                raise RuntimeError(f"{where}: top logprob {lp!r} of {key} is not a finite number <= 0")
            pairs.append((-float(lp), int(key[len(TOKEN_ID_PREFIX) :])))
        pairs.sort()
        ids[p] = [i for _, i in pairs[:k]]
        lps[p] = [-n for n, _ in pairs[:k]]
    return ids, lps
