"""Resumable problem order: which training problem is sampled next, saved in checkpoints.

The driver owns one `ProblemIterator` per environment and hands problem indices to the env actors, so the order
does not depend on how many actors there are or on which of them finishes first, and a resumed run continues it:
it neither repeats nor skips problems.

Semantics, precisely:

* Epoch e visits every index of `range(num_problems)` exactly once, in the permutation drawn from
  `SeedSequence([seed, stream, e])`. The order is a pure function of `(seed, stream, num_problems)`.
* `next()` hands out a `ProblemTicket` (index, epoch). The ticket is *outstanding* until the driver reports it
  `done` (its group reached the replay buffer, which checkpoints hold, or was rejected there) or `requeue`s it (its
  episode failed, e.g. the actor died). A requeued ticket is handed out again before any new problem.
* `state_dict()` records the epoch, the position within it, and the tickets that are requeued or still
  outstanding, in hand-out order. After `load_state_dict`, those tickets are handed out again first (with their
  original epoch, so a sampling seed derived from the ticket is the same), then the order continues at the saved
  position. So a checkpoint taken while groups are in flight loses none of their problems, and a problem whose
  group is in the checkpointed buffer is never sampled again in that epoch.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ProblemTicket:
    """One hand-out of a training problem."""

    index: int
    """Index into the environment's `train_problems()`."""
    epoch: int
    """Epoch (pass over all problems) it was handed out in; the pass-rate sampler (`marin_rl.envs.difficulty`)
    numbers its draws here instead, so every ticket, and the sampling seed derived from it, is distinct."""


def stream_id(name: str) -> int:
    """A stable 32-bit stream number for an environment name (so each environment gets its own order)."""
    return zlib.crc32(name.encode("utf-8"))


def derived_seed(*parts: int) -> int:
    """A sampling seed below 2**30 (what servers accept), a pure function of `parts`."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0]) >> 2


class TicketBook:
    """The ticket bookkeeping a problem order shares: tickets handed out and not yet done or requeued (outstanding),
    and the requeued ones, handed out again before any new problem."""

    exhausted: bool = False
    """Whether the order ran out (`ProblemStream`'s iterable); an order over a fixed problem set never does."""

    def __init__(self):
        self._requeued: deque[ProblemTicket] = deque()
        self._outstanding: dict[ProblemTicket, int] = {}  # ticket -> its rank in hand-out order

    def _settle(self, ticket: ProblemTicket) -> None:
        """Take `ticket` off the outstanding ones; KeyError if it is not outstanding."""
        if self._outstanding.pop(ticket, None) is None:
            raise KeyError(f"{ticket} is not outstanding")

    def requeue(self, ticket: ProblemTicket) -> None:
        """The ticket's episode failed: hand it out again before any new problem."""
        self._settle(ticket)
        self._requeued.append(ticket)

    @property
    def outstanding(self) -> list[ProblemTicket]:
        """Tickets handed out and not yet done or requeued, oldest first."""
        return sorted(self._outstanding, key=self._outstanding.__getitem__)


class ProblemIterator(TicketBook):
    """Seeded per-epoch shuffle over `num_problems` indices with outstanding-ticket bookkeeping (module docstring).

    Deterministic: two iterators with the same `(num_problems, seed, stream)` hand out the same tickets, and an
    iterator restored from `state_dict()` hands out what the original would have handed out after re-issuing the
    tickets that were not done.
    """

    def __init__(self, num_problems: int, seed: int, stream: int = 0):
        if num_problems < 1:
            raise ValueError(f"ProblemIterator needs at least one problem, got num_problems={num_problems}")
        self.num_problems = int(num_problems)
        self.seed = int(seed)
        self.stream = int(stream)
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)
        super().__init__()
        self._handed_out = 0

    def _permutation(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, self.stream, epoch]))
        return rng.permutation(self.num_problems)

    def next(self) -> ProblemTicket:
        """The next problem to sample: a requeued ticket if any, else a new one (`_draw`)."""
        ticket = self._requeued.popleft() if self._requeued else self._draw()
        self._outstanding[ticket] = self._handed_out
        self._handed_out += 1
        return ticket

    def _draw(self) -> ProblemTicket:
        """A new problem: the next index of the current epoch's permutation."""
        if self.position >= self.num_problems:
            self.epoch += 1
            self.position = 0
            self._order = self._permutation(self.epoch)
        ticket = ProblemTicket(int(self._order[self.position]), self.epoch)
        self.position += 1
        return ticket

    def done(self, ticket: ProblemTicket, rewards: Sequence[float] = ()) -> None:
        """The ticket's group was delivered (into the replay buffer, or rejected there): never hand it out again.
        `rewards`: its rollouts' rewards, when the group could be read (this order does not depend on them; a
        sampler that weights problems by results, `marin_rl.envs.difficulty`, records them)."""
        self._settle(ticket)

    def refresh(self) -> None:
        """A batch was formed (the driver calls this once per batch). The fixed order has nothing to update."""

    def metrics(self, env: str) -> dict[str, float]:
        """Metrics of the problem order since the last call, under `problems/{env}/...` (none for the fixed order)."""
        return {}

    def sample_seed(self, ticket: ProblemTicket) -> int:
        """A sampling seed for the ticket, a pure function of (seed, stream, epoch, index), below 2**30."""
        return derived_seed(self.seed, self.stream, ticket.epoch, ticket.index)

    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible state: the order's identity, epoch, position, and the tickets to hand out again first
        (requeued, then outstanding, each oldest first)."""
        redo = list(self._requeued) + self.outstanding
        return {
            "num_problems": self.num_problems,
            "seed": self.seed,
            "stream": self.stream,
            "epoch": self.epoch,
            "position": self.position,
            "redo": [[t.index, t.epoch] for t in redo],
        }

    SAMPLER = "order"
    """How new problems are chosen, as a checkpoint records it (`state_dict()['sampler']`; absent means this)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s output; raises ValueError if it describes a different problem order."""
        if state.get("sampler", "order") != self.SAMPLER:
            raise ValueError(
                f"the checkpointed problem order was drawn by the {state.get('sampler', 'order')!r} sampler but this "
                f"run uses {self.SAMPLER!r} (curriculum.problems changed); it cannot be resumed exactly"
            )
        for key in ("num_problems", "seed", "stream"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"the checkpointed problem order has {key}={state[key]} but this run has {getattr(self, key)} "
                    "(the environment's training problems, orchestrator.seed or the env name changed); it cannot "
                    "be resumed exactly"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_problems:
            raise ValueError(f"invalid problem iterator state: epoch={epoch}, position={position}")
        self.epoch, self.position = epoch, position
        self._order = self._permutation(epoch)
        self._requeued = deque(ProblemTicket(int(i), int(e)) for i, e in state["redo"])
        self._outstanding = {}
        self._handed_out = 0


class ProblemStream(TicketBook):
    """A problem order drawn from any iterable of problems (the Python API's `InferenceEngine.prepare_batch`
    `problems=`), with `ProblemIterator`'s ticket bookkeeping (`TicketBook`): a requeued ticket is handed out again
    before the next problem is drawn, and `problem(ticket)` is the problem a ticket stands for until it is done.

    Ticket indices number the problems in the order they were drawn (epoch 0). `source` may be replaced between
    calls (outstanding and requeued tickets keep their problems); when it is exhausted, `next` raises StopIteration
    and `exhausted` is True. The order is the caller's, so it is not checkpointed: `state_dict` raises."""

    SAMPLER = "stream"

    def __init__(self, source):
        self.origin = source
        """The iterable given (to tell whether a caller passes the same one again)."""
        self.source = iter(source)
        self.exhausted = False
        self._problems: dict[int, Any] = {}
        super().__init__()
        self._drawn = 0

    def replace_source(self, source) -> None:
        """Draw new problems from `source` from now on."""
        self.origin = source
        self.source = iter(source)
        self.exhausted = False

    def next(self) -> ProblemTicket:
        """A requeued ticket if any, else the source's next problem; StopIteration when the source is exhausted."""
        if self._requeued:
            ticket = self._requeued.popleft()
        else:
            try:
                problem = next(self.source)
            except StopIteration:
                self.exhausted = True
                raise
            ticket = ProblemTicket(self._drawn, 0)
            self._problems[self._drawn] = problem
            self._drawn += 1
        self._outstanding[ticket] = ticket.index
        return ticket

    def problem(self, ticket: ProblemTicket):
        """The problem `ticket` was handed out for."""
        return self._problems[ticket.index]

    def done(self, ticket: ProblemTicket, rewards: Sequence[float] = ()) -> None:
        """The ticket's group was delivered (or rejected): its problem is forgotten."""
        self._settle(ticket)
        del self._problems[ticket.index]

    def refresh(self) -> None:
        """A batch was formed: nothing to update."""

    def metrics(self, env: str) -> dict[str, float]:
        """No metrics of its own."""
        return {}

    def sample_seed(self, ticket: ProblemTicket) -> int:
        """A sampling seed for the ticket, a pure function of its index, below 2**30."""
        return derived_seed(stream_id("stream"), ticket.index)

    def state_dict(self) -> dict[str, Any]:
        """Refused: the caller's iterable cannot be saved."""
        raise ValueError("a problem order drawn from a caller's iterable cannot be checkpointed")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refused, as `state_dict`."""
        raise ValueError("a problem order drawn from a caller's iterable cannot be restored from a checkpoint")
