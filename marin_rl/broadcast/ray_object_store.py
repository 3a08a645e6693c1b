"""The 'ray' transport: each published version is one object in Ray's shared-memory object store."""

from __future__ import annotations

from typing import Any

import numpy as np
import ray

from marin_rl.broadcast.arrays import host_leaves
from marin_rl.broadcast.base import UpdateUnavailable, WeightTransport, WeightUpdate, register_transport


@register_transport
class RayObjectStoreTransport(WeightTransport):
    """One object in Ray's shared-memory object store per publish.

    NumPy arrays are stored out of band (pickle protocol 5): servers on the learner's node map them read-only
    without a copy, servers on other nodes pull the object once per node.
    """

    name = "ray"

    def publish(self, version: int, params: Any) -> WeightUpdate:
        leaves = host_leaves(params, self.config.dtype)
        # A list wrapping the ref keeps Ray from resolving it when the update is passed to a server actor,
        # so servers fetch it themselves (and zero-copy on the same node).
        ref = ray.put(leaves)
        self._latest = WeightUpdate(version, self.name, [ref], sum(x.nbytes for x in leaves))
        return self._latest

    def fetch(self, update: WeightUpdate) -> list[np.ndarray]:
        try:
            return ray.get(update.payload[0])
        except ray.exceptions.ObjectLostError as e:  # its owner, the learner process, died (OwnerDiedError)
            raise UpdateUnavailable(
                f"the weights of version {update.version} are gone from Ray's object store ({type(e).__name__}): "
                f"the learner that published them died"
            ) from None
