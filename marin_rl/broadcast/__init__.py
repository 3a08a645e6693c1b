"""Weight broadcast from the learner to the inference servers (see `broadcaster`)."""

from marin_rl.broadcast.broadcaster import (
    BroadcastConfig,
    WeightSubscriber,
    WeightTransport,
    WeightUpdate,
    make_transport,
)

__all__ = ["BroadcastConfig", "WeightSubscriber", "WeightTransport", "WeightUpdate", "make_transport"]
