"""Configuration of the inference servers: the policy's (`InferenceConfig`, with its vLLM and embedded Levanter
backends) and the reward models' (`RewardModelConfig`). Nothing here imports JAX."""

from __future__ import annotations

from dataclasses import dataclass, field

from marin_rl.bounds import bounded, check_fields
from marin_rl.placement import RoleResources

BACKENDS = ("levanter", "vllm")
PAUSE_MODES = ("keep", "wait", "abort")


@dataclass
class VllmConfig:
    """The vLLM backend: `vllm serve` in its own Python environment, given new weights without restarting."""

    python: str | None = None
    """Interpreter of the vLLM environment. None: $MARIN_RL_VLLM_PYTHON, else the default environment in the user's
    cache, `~/.cache/marin_rl/venvs/vllm-VERSION` (create it with `python -m marin_rl.inference.vllm_env`)."""
    dtype: str = "float32"
    """Parameter and activation dtype of the served model (`--dtype`); float32 keeps sampler logprobs exact."""
    kv_cache_gib: float | None = bounded(1.0, gt=0)
    """KV-cache memory vLLM reserves, in GiB (`--kv-cache-memory-bytes`). Needed on CPU; null on a GPU sizes it from
    `gpu_memory_utilization` instead."""
    gpu_memory_utilization: float = bounded(0.9, gt=0, le=1)
    """Fraction of accelerator memory vLLM may use when `kv_cache_gib` is null."""
    enforce_eager: bool = False
    """Skip torch.compile and CUDA graphs: starts much faster, decodes slower."""
    pause_mode: str = "keep"
    """In-flight requests during a weight update: 'keep' freezes them and continues them under the new weights
    (their KV cache is recomputed; the choice reports both versions), 'wait' lets them finish first, 'abort' cancels
    them."""
    tensor_parallel_size: int = bounded(1, ge=1)
    """GPUs one vLLM server shards the model over (`--tensor-parallel-size`); `placement.servers.num_gpus` must be
    at least this."""
    extra_args: list[str] = field(default_factory=list)
    """More `vllm serve` arguments, e.g. ['--enable-prefix-caching']."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of the vLLM process."""
    health_check_interval_s: float = bounded(10.0, gt=0)
    """How often the server is checked; a dead or unresponsive vLLM is restarted and given the current weights."""
    max_restarts: int = bounded(5, ge=0)
    """Restarts allowed before the server gives up and reports itself failed (0: none)."""
    weights_dir: str | None = None
    """Local directory where weight updates are written for vLLM to read. null: /dev/shm (memory) when it exists,
    else the system temp directory."""

    def __post_init__(self):
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"inference.vllm.pause_mode must be one of {PAUSE_MODES}, got {self.pause_mode!r}")
        check_fields(self, "inference.vllm")


KV_CACHE_DTYPES = ("float32", "bfloat16")
LEVANTER_ENGINES = ("paged", "dense")


@dataclass
class LevanterServerConfig:
    """The embedded server (backend 'levanter'): a JAX engine in the server's process, on the learner's model code."""

    engine: str = "paged"
    """'paged': Levanter's engine (paged KV cache, batched prefill, a scheduler of sequences); 'dense': marin_rl's
    dense-cache engine (`marin_rl.inference.dense_engine`: `max_seqs` slots of a dense KV cache, batched
    continuously: a group's samples share their prompt's prefill, every live slot decodes in one compiled loop, a
    slot that finishes takes a waiting or newly arrived sequence), several times faster on a CPU; it decodes Llama,
    Mistral, Qwen2, Qwen3, Qwen3-MoE and Mixtral models (the paged engine: Llama and Qwen3). `page_size` and
    `max_pages` are the paged engine's."""
    batch_invariant: bool = False
    """Dense engine: decode every batch at `max_seqs` rows instead of the smallest of a few row counts that fits, so
    a sequence's logprobs are bit-identical whatever shares its batch (across row counts they differ by ~5e-7,
    because each row count is its own compiled program). `orchestrator.deterministic` turns it on."""
    record_routing: bool = False
    """Dense engine, mixture-of-experts model: record each fed token's experts (`[slots, positions, layers × k]`
    int16 on the devices) and answer `return_routed_experts` requests with them (routing replay).
    `learner.moe.routing_replay` turns it on; off, a request for them gets none."""
    prefill_tokens: int = bounded(4096, ge=1)
    """Prompt tokens prefilled together: the paged engine admits at most this many per call (and at most
    `max_seqs`); the dense engine prefills in calls of at most this many (distinct prompts × their padded length)."""
    page_size: int = bounded(64, ge=1)
    """Tokens per KV-cache page."""
    max_pages: int | None = bounded(None, ge=1)
    """KV-cache pages per server; None gives every concurrent sequence room for `max_seq_len` tokens."""
    kv_cache_dtype: str = "float32"
    """KV-cache dtype. float32 keeps sampler logprobs within ~1e-5 of the learner's; bfloat16 drifts ~1e-2."""
    batch_timeout_s: float = bounded(0.002, ge=0)
    """How long a server waits for more concurrent requests before a decode batch starts (the batch grows while
    requests arrive less than this apart; 0: a batch starts with the requests already there). Requests that arrive
    while the engine works join at its next call anyway, so a long wait only idles the engine: under the
    quickstart's steady stream of small requests, 20 ms gave a third fewer groups per second than 0–3 ms
    (benchmarks/RESULTS.md, "The loop against its parts")."""
    max_rounds: int = bounded(16, ge=1)
    """Decode-loop iterations per device call (larger: more throughput, more latency). The dense engine returns to
    the host after this many to refill finished slots while sequences wait or may arrive."""
    segment_tokens: int | None = bounded(256, ge=1)
    """Decode long generations in segments of at most this many tokens and apply new weights between segments, so a
    generation that straddles a weight update continues under the new weights (each token's logprob from the
    weights that sampled it; the choice reports both versions). Each segment re-prefills prompt + tokens so far.
    null: a generation runs under the weights it started with, and updates wait for it."""

    def __post_init__(self):
        if self.engine not in LEVANTER_ENGINES:
            raise ValueError(f"inference.levanter.engine must be one of {LEVANTER_ENGINES}, got {self.engine!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"inference.levanter.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        check_fields(self, "inference.levanter")


@dataclass
class InferenceConfig:
    """Inference servers that env actors sample from (OpenAI-compatible completions API)."""

    backend: str = "levanter"
    """'levanter': the embedded JAX engine (shares the learner's model code; settings under `levanter`); 'vllm':
    `vllm serve` in its own Python environment (settings under `vllm`)."""
    num_servers: int = bounded(1, ge=1)
    """How many server replicas to start; clients route each request to the least-loaded one."""
    max_seqs: int = bounded(64, ge=1)
    """Sequences decoded concurrently by one server (vLLM: `--max-num-seqs`)."""
    max_seq_len: int = bounded(256, ge=2)
    """Longest prompt + completion a server accepts, in tokens (vLLM: `--max-model-len`)."""
    host: str = "auto"
    """Interface each server binds to and the address it advertises to clients: 'auto' (127.0.0.1 while the Ray
    cluster has one node, else the node's address as Ray knows it), 'node' (the node's address), '0.0.0.0' (every
    interface; advertises the node's address) or an address of the server's machine."""
    control_secret: str | None = None
    """Secret that routes changing the served model (weights, pause, resume) require as `Authorization: Bearer
    <secret>`; None: a new random secret per run, known to the driver."""
    api_key: str | None = None
    """Key the OpenAI routes (`/v1/completions`, `/v1/models`) require as `Authorization: Bearer <key>` (401
    without it); the run's own clients send it. None: those routes are open, and a server that binds beyond
    loopback (see `host`) logs a warning that anyone who reaches it can sample. `/health` and `/v1/version` are
    always open; the control routes always need `control_secret`."""
    max_n: int = bounded(128, ge=1)
    """Most choices per prompt (`n`) one request may ask for (OpenAI's bound); more is refused with a 400."""
    max_prompts: int = bounded(1024, ge=1)
    """Most prompts in one completions request; more is refused with a 400. The run's clients send at most 64."""
    request_timeout_s: float = bounded(600.0, gt=0)
    """Client-side timeout of one request."""
    startup_timeout_s: float = bounded(900.0, gt=0)
    """How long a server may take to start serving once it is placed on a node (vLLM takes minutes to start); the
    wait to be placed is `placement.wait_timeout_s`."""
    health_check_every_s: float = bounded(15.0, gt=0)
    """How often the driver asks every server for a sign of life (also whenever a group fails or an env actor
    dies); a server that does not answer within 10 s is replaced and gets the latest weights."""
    levanter: LevanterServerConfig = field(default_factory=LevanterServerConfig)
    """Settings of the embedded server (used when `backend` is 'levanter')."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """Settings of the vLLM backend (used when `backend` is 'vllm')."""

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"inference.backend must be one of {BACKENDS}, got {self.backend!r}")
        check_fields(self, "inference")
        if self.api_key is not None and (not self.api_key or self.api_key != self.api_key.strip()):
            raise ValueError("inference.api_key must be a non-empty string without surrounding whitespace, or null")
        if (
            self.backend == "levanter"
            and self.levanter.segment_tokens is not None
            and self.levanter.prefill_tokens < self.max_seq_len
        ):
            raise ValueError(
                f"inference.levanter.prefill_tokens: must be >= inference.max_seq_len ({self.max_seq_len}) when "
                "inference.levanter.segment_tokens is set (a continued sequence is prefilled with its prompt and the "
                f"tokens sampled so far), got {self.levanter.prefill_tokens}"
            )


@dataclass
class RewardModelConfig:
    """A reward model served to the environments (`reward_models` of a run config): a checkpoint written by
    `python -m marin_rl.reward_model`, served by `num_servers` reward servers (`marin_rl.inference.reward_server`).
    An environment uses it by naming it in its `reward_models`; its score is then a named reward under `name`,
    weighted by the environment's `reward_weights` like any other."""

    name: str = "reward_model"
    """The named reward it gives (in `rewards`, `reward_weights` and metrics such as `eval/ENV/rewards/NAME`)."""
    path: str = ""
    """The checkpoint directory (local path or fsspec URL such as gs://)."""
    num_servers: int = bounded(1, ge=1)
    """Reward servers of this model; clients send each request to the one with the fewest outstanding."""
    max_batch_rows: int = bounded(64, ge=1)
    """Most sequences scored in one device call; concurrent requests are batched up to this."""
    batch_timeout_s: float = bounded(0.002, ge=0)
    """How long a server waits for more requests before scoring (a batch grows while requests keep arriving less than
    this apart, up to 10 times this after its first; 0: it scores the requests already there)."""
    length_buckets: list[int] | None = None
    """Row lengths (tokens) a batch is padded to, so that the jitted call compiles once per (rows, length) bucket;
    the model's max_seq_len is always the last. null: powers of two from 16 up to max_seq_len."""
    row_buckets: list[int] | None = None
    """Row counts a batch is padded to (max_batch_rows is always the last); null: powers of 4 below max_batch_rows."""
    host: str = "auto"
    """Interface the server binds to and the address it advertises (as `inference.host`)."""
    request_timeout_s: float = bounded(600.0, gt=0)
    """Client-side timeout of one scoring request."""
    placement: RoleResources = field(default_factory=RoleResources)
    """What each of its server processes asks Ray for and how its JAX runtime is set up (e.g. `num_gpus: 1`, or
    `env: {JAX_PLATFORMS: cpu}` to keep it off an accelerator)."""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.strip() or "/" in self.name:
            raise ValueError(f"reward_models[*].name must be a non-empty name without '/', got {self.name!r}")
        check_fields(self, f"reward_models[{self.name}]")
        for field_name in ("length_buckets", "row_buckets"):
            buckets = getattr(self, field_name)
            if buckets is not None and (not buckets or any(not isinstance(b, int) or b < 1 for b in buckets)):
                raise ValueError(
                    f"reward_models[{self.name}].{field_name} must be null or positive integers, got {buckets!r}"
                )
