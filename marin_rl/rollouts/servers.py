"""`make_policy_server`: an inference server of the run's backend in this process, serving its initial policy;
`start_local_servers`: a run's policy and reward servers, started in this process.

The one way marin_rl builds a server: `InferenceEngine.local` builds its servers with it, and so does each of the
orchestrator's server actors.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

from marin_rl.config import RunConfig
from marin_rl.inference.reward_server import RewardServer
from marin_rl.model.build import build_model
from marin_rl.model.config import with_seq_len
from marin_rl.model.hf import export_hf_checkpoint


def make_policy_server(run_config: RunConfig, tokenizer, name: str, *, hf_checkpoint: str | None = None):
    """A server of `inference.backend` serving `run_config.model`'s initial policy (`init_from_hf`
    or its seeded random initialisation) as version -1: the embedded Levanter engine, or vLLM (`inference.vllm`),
    which starts from that policy exported as a Hugging Face checkpoint to a scratch directory removed by `stop`
    (or from `hf_checkpoint` when given). Not started: `server.start()` blocks until it listens and returns its
    'host:port' (and raises what the backend raises when it cannot start; vLLM names its log); then `apply_weights`,
    `pause`, `resume`, `stats`; `stop()` also when `start` failed."""
    inference = run_config.inference
    if inference.backend == "vllm":
        from marin_rl.inference.vllm_server import VllmPolicyServer

        model = build_model(with_seq_len(run_config.model, inference.max_seq_len), len(tokenizer))
        scratch = None
        if hf_checkpoint is None:
            scratch = tempfile.mkdtemp(prefix=f"marin_rl_{name}_hf_")
            hf_checkpoint = export_hf_checkpoint(model, tokenizer, scratch)
        return VllmPolicyServer(
            model, hf_checkpoint, tokenizer, inference, name=name, scratch_dir=scratch, lora=run_config.learner.lora
        )
    from marin_rl.inference.levanter_server import LevanterInferenceServer
    from marin_rl.model.precision import compute_dtype_here

    model = build_model(run_config.model, len(tokenizer))
    return LevanterInferenceServer(
        model,
        tokenizer,
        inference,
        name=name,
        lora=run_config.learner.lora,
        compute_dtype=compute_dtype_here(run_config.model.compute_dtype),
    )


@dataclass
class LocalServers:
    """Servers running in this process (`start_local_servers`)."""

    servers: list
    """The policy servers."""
    addresses: list[str]
    """Their 'host:port' addresses."""
    reward_servers: list
    """The reward models' servers."""
    reward_addresses: dict[str, list[str]]
    """The reward servers' addresses by model name."""


def start_local_servers(run_config: RunConfig, tokenizer, num_servers: int) -> LocalServers:
    """Start `num_servers` policy servers (`make_policy_server`) and `model.num_servers` servers of each reward model
    the environments use, in this process. Blocks until every one listens; when one cannot start, those already
    started are stopped and its error raised."""
    servers = []
    try:
        for i in range(num_servers):
            servers.append(make_policy_server(run_config, tokenizer, f"server-{i}"))
        addresses = [s.start() for s in servers]
        reward_servers, reward_addresses = start_reward_servers(run_config)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return LocalServers(servers, addresses, reward_servers, reward_addresses)


def start_reward_servers(run_config: RunConfig) -> tuple[list, dict[str, list[str]]]:
    """Start `model.num_servers` servers of each reward model the environments use, in this process: (the servers,
    their 'host:port' addresses by model name). Blocks until every one listens; when one cannot start, those already
    started are stopped and its error raised."""
    reward_servers, reward_addresses = [], {}
    try:
        for name in run_config.used_reward_models():
            model = run_config.reward_model(name)
            for i in range(model.num_servers):
                reward_servers.append(RewardServer.from_checkpoint(model, f"{name}-{i}"))
                reward_addresses.setdefault(name, []).append(reward_servers[-1].start())
    except BaseException:
        for s in reward_servers:
            s.stop()
        raise
    return reward_servers, reward_addresses
