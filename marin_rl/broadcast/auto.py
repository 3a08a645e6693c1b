"""The 'auto' transport (the default): 'shared_memory' on one machine, 'ray' across machines."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from typing import Any

import numpy as np
import ray

from marin_rl.broadcast.arrays import flatten_params, leaf_dtype
from marin_rl.broadcast.base import BroadcastConfig, WeightTransport, WeightUpdate, make_transport, register_transport
from marin_rl.broadcast.shared_memory import DEFAULT_ROOT, slot_count

logger = logging.getLogger(__name__)


@register_transport
class AutoTransport(WeightTransport):
    """'shared_memory' when it can work, 'ray' otherwise; the learner decides at its first publish.

    Shared memory needs every server on the learner's machine and room for its slots: it is chosen when Ray is not
    running or its cluster has one node, and the memory filesystem has room for `keep` slots of the model (with
    10% to spare). Each update names the transport that made it, so the server side follows without configuration.
    """

    name = "auto"

    def __init__(self, config: BroadcastConfig | None = None):
        super().__init__(config)
        self._transports: dict[str, WeightTransport] = {}
        self.chosen: str | None = None

    def _get(self, name: str) -> WeightTransport:
        if name not in self._transports:
            self._transports[name] = make_transport(dataclasses.replace(self.config, transport=name))
        return self._transports[name]

    def _choose(self, num_bytes: int) -> str:
        nodes = len([n for n in ray.nodes() if n.get("Alive")]) if ray.is_initialized() else 1
        root = self.config.path or DEFAULT_ROOT
        while not os.path.exists(root) and os.path.dirname(root) != root:  # the slot directory is made later
            root = os.path.dirname(root)
        try:
            free = shutil.disk_usage(root).free
        except OSError:
            free = 0
        needed = int(slot_count(self.config) * num_bytes * 1.1)
        if nodes == 1 and free >= needed:
            choice = "shared_memory"
        else:
            choice = "ray"
        logger.info(
            "broadcast.transport auto -> %s (%d Ray node(s); %s: %.0f MB free, %.0f MB needed for slots)",
            choice,
            nodes,
            root,
            free / 1e6,
            needed / 1e6,
        )
        return choice

    def publish(self, version: int, params: Any) -> WeightUpdate:
        if self.chosen is None:
            leaves = flatten_params(params)
            self.chosen = self._choose(
                sum(np.dtype(leaf_dtype(x, self.config.dtype)).itemsize * int(np.size(x)) for x in leaves)
            )
        self._latest = self._get(self.chosen).publish(version, params)
        return self._latest

    def fetch(self, update: WeightUpdate) -> list[np.ndarray]:
        return self._get(update.transport).fetch(update)

    def applied(self, update: WeightUpdate) -> None:
        self._get(update.transport).applied(update)

    def close(self) -> None:
        for transport in self._transports.values():
            transport.close()
