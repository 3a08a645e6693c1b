"""The 'in_process' transport: host copies of the arrays, for a learner and servers in one process."""

from __future__ import annotations

from typing import Any

import numpy as np

from marin_rl.broadcast.arrays import host_leaves
from marin_rl.broadcast.base import WeightTransport, WeightUpdate, register_transport


@register_transport
class InProcessTransport(WeightTransport):
    """The arrays themselves, as host copies (learner and servers share one process)."""

    name = "in_process"

    def publish(self, version: int, params: Any) -> WeightUpdate:
        leaves = host_leaves(params, self.config.dtype)
        self._latest = WeightUpdate(version, self.name, leaves, sum(x.nbytes for x in leaves))
        return self._latest

    def fetch(self, update: WeightUpdate) -> list[np.ndarray]:
        return update.payload
