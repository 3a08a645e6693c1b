"""The reward servers of a run: `reward_models[*].num_servers` `RewardServerActor`s per reward model the environments
use, started before the env actors (which get their addresses) and stopped with the run."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from marin_rl.config import RunConfig
from marin_rl.model.reward import read_reward_model_spec
from marin_rl.orchestrator.ray_backend.actors import RewardServerActor
from marin_rl.orchestrator.restarts import stop_actors
from marin_rl.placement import wait_for_actors

logger = logging.getLogger("marin_rl")


class RewardServerPool:
    """The reward models' servers and their addresses (`addresses`: model name -> 'host:port' list)."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.actors: dict[str, list] = {}
        self.addresses: dict[str, list[str]] = {}
        for name in config.used_reward_models():
            model = config.reward_model(name)
            if "://" not in model.path:  # a local path means the driver's: the actors may run elsewhere
                model = dataclasses.replace(model, path=os.path.abspath(model.path))
            spec = read_reward_model_spec(model.path)  # a missing checkpoint fails here, before any actor starts
            if spec.max_seq_len < config.inference.max_seq_len:
                longest = config.inference.max_seq_len
                logger.warning(
                    "reward model %s scores at most %d tokens, but episodes may reach inference.max_seq_len="
                    "%d; longer ones will fail",
                    name,
                    spec.max_seq_len,
                    longest,
                )
            options = model.placement.actor_options("reward_servers")
            self.actors[name] = [
                RewardServerActor.options(max_concurrency=4, **options).remote(model, f"{name}-{i}")
                for i in range(model.num_servers)
            ]

    def start(self) -> dict[str, list[str]]:
        """Wait until every server listens (bounded by `placement.wait_timeout_s`, naming what is missing; a checkpoint
        that cannot be loaded raises its error); returns the addresses by model name."""
        if not self.actors:
            return {}
        t = time.time()
        pending = {name: [(a, a.get_address.remote()) for a in actors] for name, actors in self.actors.items()}
        requests = {name: self.config.reward_model(name).placement for name in self.actors}
        self.addresses = wait_for_actors(pending, requests, self.config.placement.wait_timeout_s)
        logger.info("reward servers up at %s (%.1fs)", self.addresses, time.time() - t)
        return self.addresses

    def stop(self) -> None:
        """Stop every server (10 s each at most) and kill its actor."""
        for actors in self.actors.values():
            stop_actors(actors)
        self.actors = {}
