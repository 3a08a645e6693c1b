"""Weight broadcast from the learner to the inference servers (see `marin_rl.broadcast.base`)."""

from marin_rl.broadcast.base import (
    BroadcastConfig,
    WeightSubscriber,
    WeightTransport,
    WeightUpdate,
    known_transports,
    make_transport,
    register_transport,
)

__all__ = [
    "BroadcastConfig",
    "WeightSubscriber",
    "WeightTransport",
    "WeightUpdate",
    "known_transports",
    "make_transport",
    "register_transport",
]
