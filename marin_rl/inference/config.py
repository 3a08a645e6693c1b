"""Configuration of the inference servers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class InferenceConfig:
    """Inference servers that env actors sample from (OpenAI-compatible completions API)."""

    backend: str = "levanter"
    """'levanter': the embedded JAX engine (shares the learner's model code)."""
    num_servers: int = 1
    """How many server replicas to start; clients route each request to the least-loaded one."""
    max_seqs: int = 64
    """Sequences decoded concurrently by one server."""
    max_seq_len: int = 256
    """Longest prompt + completion a server accepts, in tokens."""
    prefill_tokens: int = 4096
    """Prompt tokens prefilled together; one engine call admits at most this many (and at most `max_seqs`)."""
    page_size: int = 64
    """Tokens per KV-cache page."""
    max_pages: int | None = None
    """KV-cache pages per server; None gives every concurrent sequence room for `max_seq_len` tokens."""
    kv_cache_dtype: str = "float32"
    """KV-cache dtype. float32 keeps sampler logprobs within ~1e-5 of the learner's; bfloat16 drifts ~1e-2."""
    batch_timeout_s: float = 0.02
    """How long a server waits to gather concurrent requests into one decode batch."""
    max_rounds: int = 16
    """Decode-loop iterations per engine call (larger: more throughput, more latency)."""
    host: str = "127.0.0.1"
    """Interface the HTTP servers bind to."""
    request_timeout_s: float = 600.0
    """Client-side timeout of one request."""
    startup_timeout_s: float = 300.0
    """How long to wait for a server to become healthy."""
